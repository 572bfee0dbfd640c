"""The service's pages say what happens to an exempt server that someone suspended by hand:
the suspension, not "Exempt: never suspended". Real Hub, proxy, Snap spawner, kernel, CRIU
and service process."""

from __future__ import annotations

import re

import pytest

from jupyterhub_gpusnap.handlers.pages import badge_state, state_words
from tests.helpers.gpusnap_service import GpuSnapService
from tests.helpers.local_hub import snap_config

SINCE = "2026-01-02T03:04:05Z"


@pytest.mark.parametrize(
    ("state", "badge", "words"),
    [
        ("exempt", "exempt", "Exempt: never suspended."),
        ("active", "exempt", "Exempt: never suspended."),
        ("idle", "exempt", "Exempt: never suspended."),
        ("suspending", "suspending", "Being suspended: its kernels are being saved to disk."),
        ("suspended", "suspended",
         "Suspended at 2026-01-02 03:04 UTC to free the GPU; your kernels are saved."),
        ("restoring", "restoring", "Being restored from its snapshot."),
        ("failed", "failed", "Suspending it failed (criu dump failed); it keeps running."),
    ],
)  # fmt: skip
def test_an_exempt_server_shows_what_a_suspend_now_did(state, badge, words):
    s = {"state": state, "exempt": True, "state_since": SINCE, "action": "suspend",
         "keep_until": "9999-12-31T23:59:59Z", "failure": "criu dump failed", "reason": None}  # fmt: skip
    assert badge_state(s) == badge
    assert state_words(s) == words


@pytest.mark.e2e
@pytest.mark.criu
async def test_exempt_server_suspended_now_is_shown_suspended(hub_factory, tmp_path):
    ckpt = tmp_path / "ckpt"
    service = GpuSnapService(tmp_path / "gpusnap", f"""
c.GpuSnap.interval = 1
c.GpuSnap.idle_window = 3600
c.GpuSnap.min_running = 0
c.GpuSnap.warn_before = 0
c.GpuSnap.action = "suspend"
c.GpuSnap.signal_classes = ["jupyterhub_gpusnap.signals.jupyter.JupyterSignal"]
c.LocalBackend.checkpoint_dir = {str(ckpt)!r}
c.LocalBackend.min_free_bytes = 0
""")  # fmt: skip
    hub = await hub_factory(snap_config(ckpt, service.hub_config()))
    await hub.start_server("alice")
    _, out = await hub.execute("alice", "x = 42\nprint('set')")
    assert out.strip() == "set"
    await service.start(hub)
    await service.wait_for(lambda: service.server_status("alice/"), what="alice watched")
    code, body = await service.api("POST", "api/servers/alice/exempt", {"exempt": True})
    assert code == 200 and body["exempt"], body
    code, page = await service.api("GET", "status/alice/")
    assert code == 200 and '<span class="badge" data-state="exempt">exempt</span>' in page, page

    code, body = await service.api("POST", "api/servers/alice/suspend", {})  # "Suspend now"
    assert code == 202, body

    async def suspended():
        s = await service.server_status("alice/")
        return s if s and s["state"] == "suspended" else None

    alice = await service.wait_for(suspended, timeout=120, what="alice's server suspended")
    assert alice["exempt"] is True  # the exemption stays for the next run

    code, page = await service.api("GET", "status/alice/")  # the user's status page
    assert code == 200, page
    assert '<span class="badge" data-state="suspended">suspended</span>' in page, page
    assert re.search(
        r'class="state-words">Suspended at [^<]+ to free the GPU; your kernels are saved\.<', page
    ), page
    assert "never suspended" not in page, page
    code, page = await service.api("GET", "admin")  # the admin overview
    assert code == 200, page
    row = re.search(r'<tr data-server="alice/">.*?</tr>', page, re.S)
    assert row and '<span class="badge" data-state="suspended">suspended</span>' in row.group(0)
    assert '<span class="badge" data-state="exempt">' not in page, page  # nor in the counts
