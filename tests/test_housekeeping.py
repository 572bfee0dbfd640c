"""The service's housekeeping: the admin's daily digest (real SMTP server) and checkpoint retention."""

from __future__ import annotations

import pytest
from smtp_server import SmtpServer

from jupyterhub_gpusnap.app import GpuSnap

pytestmark = pytest.mark.email


async def test_daily_digest_is_sent_once_with_the_days_numbers(tmp_path, monkeypatch):
    (tmp_path / "smtp").mkdir()
    smtp = SmtpServer(tmp_path / "smtp", tls="none").start()
    cfg = tmp_path / "gpusnap_config.py"
    cfg.write_text(f"""
c.GpuSnap.db_url = "sqlite:///{tmp_path}/gpusnap.sqlite"
c.GpuSnap.email = True
c.LocalBackend.checkpoint_dir = "{tmp_path}/ckpt"
c.Mailer.smtp_host = "127.0.0.1"
c.Mailer.smtp_port = {smtp.port}
c.Mailer.smtp_security = "none"
c.Mailer.from_address = "gpusnap@example.org"
c.Notifier.address_from = "template"
c.Notifier.address_template = "{{username}}@example.org"
c.Notifier.digest_to = ["gpu-admins@example.org"]
c.Notifier.digest_hour = 0
""")
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "unused-here")
    app = GpuSnap()
    app.initialize(["--config", str(cfg)])
    try:
        app.store.record_event("alice/", "suspend", {"image_bytes": 1})
        app.store.record_event("bob/", "suspend", {"image_bytes": 1})
        app.store.record_event("alice/", "restore", {})
        app.store.record_event("carol/", "suspend_failed", {"error": "criu dump failed"})
        await app.housekeeping()
        await app.housekeeping()  # the same day: not again
        await app.notifier.drain()
        digests = [m for m in smtp.messages if m.rcpt_tos == ["gpu-admins@example.org"]]
        assert len(digests) == 1
        text = digests[0].part("plain")
        assert "carol/" in text and "criu dump failed" in text
        context = app.digest_context(app.store.events(None, limit=1)[0]["time"])
        assert (context["suspensions"], context["restores"], context["failures"]) == (2, 1, 1)
        # retention ran too (nothing to delete in an empty checkpoint folder)
        assert app._last_retention > 0
    finally:
        smtp.stop()


def test_digest_gpu_hours_count_the_last_24_hours_only():
    from jupyterhub_gpusnap.app import gpu_hours_freed

    now = 1_800_000_000.0
    h = 3600.0

    def ev(i, key, kind, hours_ago, gpus=None):
        detail = {"gpu_count": gpus} if gpus is not None else {}
        return {"id": i, "key": key, "kind": kind, "time": now - hours_ago * h, "detail": detail}

    events = [
        ev(1, "alice/", "suspend", 72, gpus=2),  # still suspended: 24 h x 2 GPUs in the window
        ev(2, "bob/", "suspend", 30, gpus=1),  # restored 20 h ago: 4 h in the window
        ev(3, "bob/", "restore", 20),
        ev(4, "carol/", "suspend", 5, gpus=1),  # restore failed 2 h ago: 3 h
        ev(5, "carol/", "restore_failed", 2),
        ev(6, "dave/", "suspend", 50, gpus=4),  # restored before the window: nothing
        ev(7, "dave/", "restore", 40),
        ev(8, "erin/", "suspend", 1, gpus=0),  # a CPU-only server: nothing
    ]
    assert gpu_hours_freed(list(reversed(events)), now - 24 * h, now) == pytest.approx(48 + 4 + 3)
