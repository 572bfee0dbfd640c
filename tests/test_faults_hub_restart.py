"""Faults: the Hub, or the service itself, goes down in the middle of a suspension.

Hub down: the service checkpoints a server (verified, processes ended) while the Hub is
down, so its "stop this server" call cannot reach the Hub. When the Hub comes back, its
start-up poll of the spawner finds the server's process gone and the spawner sees why: a
verified checkpoint of that very run. The server ends up stopped-and-restorable, never
neither: the user's next spawn restores the same kernel with the same variables.

Service killed: the service's process group is killed after CRIU finished the dump and
before the service verified it. At restart the backend completes the checkpoint ("completed
at recovery") and the service finishes the suspension from its database and that outcome:
the server is stopped in the Hub, shown suspended by the API, the user gets the suspended
email once (also after a second crash), and exemptions and keep-running survive.

Real Hub, proxy, Snap spawner, kernel, CRIU, service process and SMTP server.
"""

from __future__ import annotations

import asyncio
import re
import shutil
from pathlib import Path

import pytest

from jupyterhub_gpusnap.checkpoint.manifest import Manifest
from jupyterhub_gpusnap.model import Server
from jupyterhub_gpusnap.procs import is_alive
from tests.helpers.gpusnap_service import GpuSnapService
from tests.helpers.local_hub import service_backend, snap_config
from tests.helpers.smtp_server import SmtpServer

pytestmark = [pytest.mark.faults, pytest.mark.e2e, pytest.mark.criu]


async def test_hub_down_during_a_suspension_ends_restorable(hub_factory, tmp_path):
    ckpt = tmp_path / "ckpt"
    # servers outlive the Hub (as in production): the suspension happens while it is down
    hub = await hub_factory(snap_config(ckpt, "c.JupyterHub.cleanup_servers = False"))
    backend = service_backend(ckpt)
    await hub.start_server("alice")
    kid, out = await hub.execute("alice", "x = 42\nprint('set')")
    assert out.strip() == "set"
    model = await hub.get_server("alice")
    pid = model["state"]["pid"]

    await hub.stop_hub()
    assert is_alive(pid)  # the server runs on without the Hub
    # the service's suspension: checkpoint verified and processes ended; its stop call
    # to the Hub would fail now (the watcher leaves that to the Hub's poll)
    info = await backend.checkpoint(Server(user="alice", name="", state=model["state"]))
    assert info.status == "verified" and not is_alive(pid)

    await hub.restart()
    # the Hub's start-up poll found the process gone: stopped, with its checkpoint noted
    assert await hub.get_server("alice") is None
    assert "alice/: suspended (checkpoint" in hub.log_text()

    await hub.start_server("alice")
    kid2, out = await hub.execute("alice", "print(x)", kernel_id=kid)
    assert kid2 == kid and out.strip() == "42"
    assert Manifest.load(backend.folder(info.id)).status == "restored"


# criu, as the service runs it, except that after a successful dump of a server (into the
# checkpoint folder; not the start-up probe's) it reports so and then waits as long as the
# service that ran it lives: the dump is complete on disk and the service has not verified it
# yet, the moment the kill below aims at
CRIU_THAT_WAITS = """#!/bin/sh
{criu} "$@"
rc=$?
case "$*" in
  "dump "*"-D {ckpt}/"*)
    if [ $rc -eq 0 ]; then
        touch {marker}
        while kill -0 $PPID 2>/dev/null; do sleep 0.1; done
    fi;;
esac
exit $rc
"""


def service_settings(ckpt: Path, criu: Path, smtp: SmtpServer) -> str:
    return f"""
c.GpuSnap.interval = 1
c.GpuSnap.idle_window = 3600
c.GpuSnap.min_running = 0
c.GpuSnap.warn_before = 0
c.GpuSnap.action = "suspend"
c.GpuSnap.signal_classes = ["jupyterhub_gpusnap.signals.jupyter.JupyterSignal"]
c.LocalBackend.checkpoint_dir = {str(ckpt)!r}
c.LocalBackend.min_free_bytes = 0
c.LocalBackend.criu_path = {str(criu)!r}
c.GpuSnap.email = True
c.Mailer.smtp_host = {smtp.host!r}
c.Mailer.smtp_port = {smtp.port}
c.Mailer.smtp_security = "none"
c.Mailer.retries = 0
c.Notifier.address_from = "template"
c.Notifier.address_template = "{{username}}@example.org"
"""


async def ticks(service: GpuSnapService) -> int:
    """How many ticks the service process has finished (its loop-duration histogram's count)."""
    code, text = await service.api("GET", "metrics")
    assert code == 200, text
    m = re.search(r"^gpusnap_loop_duration_seconds_count (\S+)$", text, re.M)
    return int(float(m.group(1))) if m else 0


async def test_service_crash_then_api_email_keep_state(hub_factory, tmp_path):
    ckpt = tmp_path / "ckpt"
    marker = tmp_path / "dump-finished"
    criu = tmp_path / "criu-that-waits"
    real = shutil.which("criu") or "/usr/local/sbin/criu"
    criu.write_text(CRIU_THAT_WAITS.format(criu=real, ckpt=ckpt, marker=marker))
    criu.chmod(0o755)
    smtp = SmtpServer(tmp_path, tls="none").start()
    service = GpuSnapService(tmp_path / "gpusnap", service_settings(ckpt, criu, smtp))
    hub = await hub_factory(snap_config(ckpt, service.hub_config()))
    try:
        await hub.start_server("alice")
        await hub.start_server("bob")
        kid, out = await hub.execute("alice", "x = 42\nprint('set')")
        assert out.strip() == "set"
        await service.start(hub)
        await service.wait_for(lambda: both_watched(service), what="alice and bob watched")

        # an admin exempts alice's server and bob keeps his running: both must outlive crashes
        code, body = await service.api("POST", "api/servers/alice/exempt", {"exempt": True})
        assert code == 200 and body["exempt"], body
        code, body = await service.api("POST", "api/servers/bob/keep", {"seconds": 3600})
        assert code == 200, body
        bob_keep = body["keep_until"]

        # "suspend now" (an exemption stays), then kill the service once CRIU's dump is complete
        code, body = await service.api("POST", "api/servers/alice/suspend", {})
        assert code == 202, body
        await service.wait_for(
            lambda: asyncio.sleep(0, marker.exists()), timeout=120, what="the dump to finish"
        )
        await service.kill()
        [folder] = [p for p in (ckpt / "alice" / "_default").iterdir() if p.is_dir()]
        assert (
            '"status": "writing"' in (folder / "manifest.json").read_text()
        )  # not verified by the service
        assert smtp.messages == []

        await service.start(hub)
        assert "completed at recovery" in service.log_text()

        async def suspended():
            s = await service.server_status("alice/")
            return s if s and s["state"] == "suspended" else None

        alice = await service.wait_for(
            suspended, timeout=120, what="alice shown suspended after the restart"
        )
        assert alice["checkpoint_id"] == f"alice/_default/{folder.name}", alice
        assert alice["exempt"] is True
        code, page = await service.api("GET", "status/alice/")  # the user's status page
        assert (
            code == 200 and '<span class="badge" data-state="suspended">suspended</span>' in page
        ), page
        assert await hub.get_server("alice") is None  # stopped in the Hub, restorable
        bob = await service.server_status("bob/")
        assert bob["keep_until"] == bob_keep and bob["state"] == "active", bob

        async def one_email():
            return [m for m in smtp.messages if m.rcpt_tos == ["alice@example.org"]]

        [mail] = await service.wait_for(one_email, what="alice's suspended email")
        assert "alice/ was suspended" in mail.subject
        code, events = await service.api("GET", "api/events?server=alice/")
        kinds = [e["kind"] for e in events["events"]]
        assert kinds.count("suspend") == 1, kinds

        # a second crash and restart: no second email, state and exemption as they were
        await service.kill()
        await service.start(hub)
        await service.wait_for(
            lambda: ticks_past(service, 3), what="three ticks after the second restart"
        )
        assert len(smtp.messages) == 1, [m.subject for m in smtp.messages]
        alice = await service.server_status("alice/")
        assert alice["state"] == "suspended" and alice["exempt"] is True, alice
        assert (await service.server_status("bob/"))["keep_until"] == bob_keep

        # the user comes back: the same kernel, and the exemption still holds
        await hub.start_server("alice")
        kid2, out = await hub.execute("alice", "print(x)", kernel_id=kid)
        assert kid2 == kid and out.strip() == "42"

        async def back():
            s = await service.server_status("alice/")
            return s if s and s["state"] != "suspended" else None

        alice = await service.wait_for(back, what="alice seen restored")
        assert alice["exempt"] is True, alice
    finally:
        await service.stop()
        smtp.stop()


async def both_watched(service: GpuSnapService) -> bool:
    return all([await service.server_status("alice/"), await service.server_status("bob/")])


async def ticks_past(service: GpuSnapService, n: int) -> bool:
    return await ticks(service) >= n
