"""The suspended email after a crash: once, whatever moment the service dies at.

The dangerous moment is after the "suspended" email was claimed and before the server was
recorded suspended: the next start finds the server still ``suspending`` and finishes the
suspension again. The email's event is the checkpoint, so the second claim finds the first
and nothing is sent twice. The crash is the watcher dying at that point (the state write
raises, as a killed process never makes it); everything else is real: the service's
database (SQLite file), a real Hub, the Notifier delivering through a real SMTP server.
The checkpoint backend holds one verified checkpoint, as ``LocalBackend.recover`` leaves a
checkpoint it "completed at recovery" (tests/test_faults_hub_restart.py does that part with
CRIU).
"""

from __future__ import annotations

import time

import pytest

from jupyterhub_gpusnap.checkpoint.base import CheckpointBackend, CheckpointInfo
from jupyterhub_gpusnap.hub import HubClient
from jupyterhub_gpusnap.model import State
from jupyterhub_gpusnap.notify import Mailer, ServiceNotifier
from jupyterhub_gpusnap.policy import Policy, Rule, ServerStatus
from jupyterhub_gpusnap.store import Store
from jupyterhub_gpusnap.watcher import Watcher
from tests.helpers.smtp_server import SmtpServer

pytestmark = [pytest.mark.e2e, pytest.mark.email]


class HeldBackend(CheckpointBackend):
    """A backend holding checkpoints already verified (what recovery left); takes no new ones."""

    def __init__(self, infos: list[CheckpointInfo], **kwargs):
        super().__init__(**kwargs)
        self.infos = {i.id: i for i in infos}

    async def latest(self, user: str, server_name: str) -> CheckpointInfo | None:
        found = [i for i in self.infos.values() if (i.user, i.server_name) == (user, server_name)]
        return max(found, key=lambda i: i.created) if found else None

    async def list(self, user: str | None = None) -> list[CheckpointInfo]:
        return sorted(self.infos.values(), key=lambda i: i.created, reverse=True)


class Killed(BaseException):
    """The service process dies here."""


def make_watcher(hub, db: str, backend: CheckpointBackend, smtp: SmtpServer) -> Watcher:
    store = Store(db)
    mailer = Mailer(smtp_host=smtp.host, smtp_port=smtp.port, smtp_security="none", retries=0)
    notifier = ServiceNotifier(sent_log=store, mailer=mailer, address_from="template",
                               address_template="{username}@example.org")  # fmt: skip
    return Watcher(
        hub=HubClient(api_url=hub.api_url, api_token=hub.admin_token),
        store=store,
        policy=Policy(rules=[], default=Rule(name="default", idle_window=3600)),
        sources=[],
        backend=backend,
        notifier=notifier,
    )


async def test_crash_after_the_claim_sends_no_second_email(hub_factory, tmp_path):
    hub = await hub_factory()
    await hub.ensure_user("alice")  # her server is not running: the Hub saw it end
    smtp = SmtpServer(tmp_path, tls="none").start()
    db = f"sqlite:///{tmp_path / 'gpusnap.sqlite'}"
    t0 = time.time() - 60
    with Store(db) as store:  # what the killed service left: a suspension under way, kept running
        store.put(ServerStatus(key="alice/", user="alice", state=State.suspending, state_since=t0,
                               last_active=t0 - 3600, started=t0 - 7200, keep_until=None,
                               reason="idle 1h00m >= idle_window"))  # fmt: skip
    info = CheckpointInfo(id="alice/_default/20261125T120000.000000Z", user="alice", server_name="",
                          created=t0 + 1, status="verified", image_bytes=123 << 20)  # fmt: skip
    backend = HeldBackend([info])
    try:
        # first start: finishes the suspension, claims and sends the email, then dies before
        # recording the server suspended
        first = make_watcher(hub, db, backend, smtp)
        real_execute = first.execute

        def dies_at_suspended(status, kind, *args, **kwargs):
            if kind == "suspended":
                raise Killed()
            return real_execute(status, kind, *args, **kwargs)

        first.execute = dies_at_suspended
        await first.tick()
        [finishing] = first._inflight.values()
        with pytest.raises(Killed):
            await finishing
        await first.notifier.drain()
        assert first.store.get("alice/").state == State.suspending
        assert [m.rcpt_tos for m in smtp.messages] == [["alice@example.org"]]
        first.store.close()

        # second start: finishes it again, records it, finds the email claimed
        second = make_watcher(hub, db, backend, smtp)
        await second.tick()
        await second.wait_idle()
        await second.notifier.drain()
        status = second.store.get("alice/")
        assert status.state == State.suspended and status.checkpoint_id == info.id
        assert len(smtp.messages) == 1, [m.subject for m in smtp.messages]
        [event] = [e for e in second.store.events("alice/") if e["kind"] == "suspend"]
        assert event["detail"]["recovered"] is True
        second.store.close()

        # a third start changes nothing
        third = make_watcher(hub, db, backend, smtp)
        await third.tick()
        await third.wait_idle()
        await third.notifier.drain()
        assert third.store.get("alice/").state == State.suspended
        assert len(smtp.messages) == 1
        third.store.close()
    finally:
        smtp.stop()
