"""The service's housekeeping: the admin's daily digest (real SMTP server) and checkpoint retention."""

from __future__ import annotations

import pytest

from jupyterhub_gpusnap.app import GpuSnap
from tests.helpers.shared_chunks import suspend_two
from tests.helpers.smtp_server import SmtpServer

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
        # a suspension cut short by a service restart (watcher.py) is a failure too
        app.store.record_event("dave/gpu", "suspend_interrupted", {"error": "the service stopped"})
        await app.housekeeping()
        await app.housekeeping()  # the same day: not again
        await app.notifier.drain()
        digests = [m for m in smtp.messages if m.rcpt_tos == ["gpu-admins@example.org"]]
        assert len(digests) == 1
        text = digests[0].part("plain")
        assert "carol/" in text and "criu dump failed" in text
        assert "dave/gpu" in text and "the service stopped" in text
        context = app.digest_context(app.store.events(None, limit=1)[0]["time"])
        assert (context["suspensions"], context["restores"], context["failures"]) == (2, 1, 2)
        assert sorted(f["server"] for f in context["failed_servers"]) == ["carol/", "dave/gpu"]
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


@pytest.mark.criu
async def test_housekeeping_runs_the_chunk_scrub_and_a_failed_scrub_is_logged_not_fatal(
    tmp_path, monkeypatch, process_tree, caplog
):
    """Two users' snapshots share chunks: the service's housekeeping starts the backend's
    scrub, which stores those chunks twice. A scrub that fails (here its state file cannot
    be written) is logged; housekeeping goes on, and the next round scrubs again."""
    from jupyterhub_gpusnap.checkpoint.chunks import PLAIN
    from jupyterhub_gpusnap.checkpoint.scrub import STATE

    cfg = tmp_path / "gpusnap_config.py"
    cfg.write_text(f"""
c.GpuSnap.db_url = "sqlite:///{tmp_path}/gpusnap.sqlite"
c.LocalBackend.checkpoint_dir = "{tmp_path}/ckpt"
c.LocalBackend.storage = "chunks"
c.LocalBackend.min_free_bytes = 0
c.LocalBackend.average_chunk_bytes = {64 << 10}
""")
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "unused-here")
    app = GpuSnap()
    app.initialize(["--config", str(cfg)])
    app.log.addHandler(caplog.handler)  # the service's logger does not propagate
    backend = app.backend
    _, _, _, shared = await suspend_two(backend, process_tree)
    store = backend.chunk_store()
    space = PLAIN  # not encrypted
    assert shared and not any(store.replica_path(space, c).exists() for c in shared)

    # 1. the scrub fails: logged, housekeeping returns, the digest's turn still comes
    obstacle = store.root / STATE
    obstacle.mkdir()
    (obstacle / "in-the-way").write_text("")
    await app.housekeeping()
    assert app._scrub_task is not None
    await app._scrub_task  # the failure stays inside the task

    def failures():
        return [r for r in caplog.records if r.getMessage().startswith("Checkpoint scrub failed:")]

    failed = failures()
    assert len(failed) == 1 and failed[0].levelname == "ERROR"
    assert "Is a directory" in failed[0].getMessage()

    # 2. the next round (an hour later) scrubs again: every shared chunk has its replica
    (obstacle / "in-the-way").unlink()
    obstacle.rmdir()
    app._last_retention = 0.0
    await app.housekeeping()
    await app._scrub_task
    for cid in shared:
        replica = store.replica_path(space, cid)
        assert replica.is_file() and replica.read_bytes() == store.path(space, cid).read_bytes()
    assert obstacle.is_file()  # the full pass ended and recorded it
    assert failures() == failed  # no new failure
