"""The whole product on one machine: the real service suspends an idle server, the user comes back.

A real hub with the Snap spawner, the real service (local CRIU backend, email through a real
SMTP server with STARTTLS and login), a kernel holding ``x = 42`` and an open file. The service
warns, checkpoints, verifies and stops the server; the user's next spawn restores it: the same
kernel answers 42. Exactly one email of each kind arrives.
"""

from __future__ import annotations

import pytest

from tests.helpers.gpusnap_service import GpuSnapService
from tests.helpers.local_hub import settings, snap_config
from tests.helpers.smtp_server import SmtpServer

pytestmark = [pytest.mark.e2e, pytest.mark.criu, pytest.mark.email]


async def test_idle_server_is_suspended_by_the_service_and_restored_on_return(
    hub_factory, tmp_path
):
    ckpt = tmp_path / "checkpoints"
    (tmp_path / "smtp").mkdir()
    smtp = SmtpServer(tmp_path / "smtp").start()
    service = GpuSnapService(tmp_path / "gpusnap", settings(ckpt, smtp))
    hub = await hub_factory(snap_config(ckpt) + service.hub_config())
    try:
        await hub.start_server("alice")
        kernel, out = await hub.execute(
            "alice",
            "x = 42\nf = open('notes.txt', 'w'); f.write('kept open'); f.flush()\nprint('set')",
        )
        assert "set" in out
        await service.start(hub)

        async def suspended():
            status = await service.server_status("alice/")
            return status if status and status["state"] == "suspended" else None

        status = await service.wait_for(
            suspended, timeout=120, what="alice's server to be suspended"
        )
        assert await hub.get_server("alice") is None  # stopped: the GPU (here: the host) is free
        assert status["checkpoint_id"]
        manifests = list(ckpt.glob("alice/*/*/manifest.json"))
        assert manifests, "the checkpoint is on disk"
        assert oct(manifests[0].stat().st_mode & 0o777) == "0o600"  # owner-only

        # the user comes back: the spawn restores the same kernel with its variables
        await hub.start_server("alice")
        same, out = await hub.execute("alice", "print(x, f.closed)", kernel_id=kernel)
        assert same == kernel and out.strip() == "42 False"
        # and keeps it running a while (within the admin's maximum), so it is not suspended again
        alice = await hub.user_token("alice")
        code, _ = await service.api("POST", "api/servers/alice/keep", {"seconds": 600}, token=alice)
        assert code == 200

        async def restored():
            s = await service.server_status("alice/")
            return s if s and s["state"] == "active" and s["restored_at"] else None

        status = await service.wait_for(restored, timeout=60, what="the service to see the restore")
        kinds = [e["kind"] for e in status["events"]]
        assert "suspend" in kinds and "restore" in kinds and "warn" in kinds, kinds

        async def three_emails():
            return len(smtp.messages) >= 3

        await service.wait_for(three_emails, timeout=60, what="three emails")
        subjects = [m.subject for m in smtp.messages]
        assert all(m.rcpt_tos == ["alice@example.org"] for m in smtp.messages)
        assert len(smtp.messages) == 3, subjects  # warning, suspended, restored: once each
        suspended_mail = smtp.messages[1].part("plain")
        assert "alice" in suspended_mail

        code, text = await service.api("GET", "metrics")
        assert 'gpusnap_actions_total{action="suspend",result="ok"} 1.0' in text
        assert 'gpusnap_actions_total{action="restore",result="ok"} 1.0' in text

        # deleting the user deletes their checkpoints (they hold the user's memory)
        await hub.stop_server("alice")
        code, _ = await hub.api("DELETE", "/users/alice")
        assert code == 204
        assert not list(ckpt.glob("alice/*/*/manifest.json"))
    finally:
        await service.stop()
        smtp.stop()
