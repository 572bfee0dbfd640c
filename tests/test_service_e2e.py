"""The service end to end: a real hub, proxy, single-user servers with live kernels, and the service.

Windows are a few seconds long so the tests run quickly; nothing is faked.
"""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from tests.helpers.browser_tab import open_tab, send_execute
from tests.helpers.gpusnap_service import GpuSnapService

pytestmark = pytest.mark.e2e

SETTINGS = """
c.GpuSnap.interval = 1
c.GpuSnap.idle_window = 6
c.GpuSnap.min_running = 0
c.GpuSnap.warn_before = 0
c.GpuSnap.action = "stop"
c.GpuSnap.cpu_threshold = 20
c.GpuSnap.rules = [{"name": "vip", "users": ["dave"], "exempt": True}]
"""


async def status_last_activity(hub, user: str) -> str:
    code, data = await hub.user_request(user, "api/status?no_track_activity=1")
    assert code == 200, data
    return data["last_activity"]


@pytest.fixture
async def hub_and_service(hub_factory, tmp_path):
    service = GpuSnapService(tmp_path / "gpusnap", SETTINGS)
    hub = await hub_factory(service.hub_config())
    yield hub, service
    await service.stop()


async def test_truly_idle_is_stopped_and_working_servers_are_not(hub_and_service):
    hub, service = hub_and_service
    for user in ("alice", "bob", "carol", "dave"):
        await hub.start_server(user)
    # alice: a kernel that ran a cell, then only an open tab with websocket pings
    alice_kernel, out = await hub.execute("alice", "x = 1; print('ok')")
    assert "ok" in out
    tab = await open_tab(hub, "alice", alice_kernel)
    # bob: a long silent cell (no output for minutes)
    bob_kernel, _ = await hub.execute("bob", "import time")
    bob_ws = await open_tab(hub, "bob", bob_kernel)
    await send_execute(bob_ws, "time.sleep(600)")
    # carol: CPU busy in a child process, no GPU, kernel idle
    await hub.execute(
        "carol",
        "import subprocess, sys\np = subprocess.Popen([sys.executable, '-c', 'while True: pass'])",
    )
    # dave: exempt; used to check the service's polls leave his server's activity alone
    dave_before = await status_last_activity(hub, "dave")

    await service.start(hub)

    async def bob_reported_busy():
        # the servers report their kernels themselves; bob's report says his cell runs
        status = await service.server_status("bob/")
        return status and status["signals"].get("kernels_busy") == 1

    await service.wait_for(bob_reported_busy, what="bob's server to report its busy kernel")

    async def alice_stopped():
        return await hub.get_server("alice") is None

    await service.wait_for(alice_stopped, timeout=90, what="alice's idle server to be stopped")
    tab.close()

    # the others have been watched for longer than the idle window by now
    bob = await service.server_status("bob/")
    carol = await service.server_status("carol/")
    dave = await service.server_status("dave/")
    assert await hub.get_server("bob") is not None
    assert await hub.get_server("carol") is not None
    assert bob["state"] == "active" and "busy" in bob["reason"], bob
    assert bob["signals"]["kernels_busy"] == 1
    assert carol["state"] == "active" and "cpu" in carol["reason"], carol
    assert carol["signals"]["cpu_percent"] > 20
    assert dave["state"] == "exempt", dave
    # many ticks of polling later, dave's own last_activity has not moved
    assert await status_last_activity(hub, "dave") == dave_before

    # the stop is recorded and counted: once the Hub's stop call has returned to the service,
    # which may be a moment after the Hub lists the server as stopped
    async def stop_recorded():
        code, events = await service.api("GET", "api/events?server=alice/")
        assert code == 200
        return "stop" in [e["kind"] for e in events["events"]]

    await service.wait_for(stop_recorded, timeout=30, what="alice's stop to be recorded")
    code, text = await service.api("GET", "metrics")
    assert code == 200
    assert 'gpusnap_actions_total{action="stop",result="ok"} 1.0' in text
    bob_ws.close()


async def test_restart_keeps_the_idle_clock(hub_factory, tmp_path):
    settings = SETTINGS.replace("idle_window = 6", "idle_window = 3600")
    service = GpuSnapService(tmp_path / "gpusnap", settings)
    hub = await hub_factory(service.hub_config())
    await hub.start_server("erin")
    await service.start(hub)

    async def seen():
        # idle by a reading of her kernels (her server has reported them)
        s = await service.server_status("erin/")
        ok = s and s["idle_seconds"] is not None and s["signals"].get("kernels") is not None
        return s if ok else None

    before = await service.wait_for(seen, what="erin's first sample")
    await service.kill()  # no clean shutdown
    await service.start(hub)
    after = await service.wait_for(seen, what="erin after restart")
    # the idle clock continues from the same last_active (it was persisted), it did not restart
    assert after["last_active"] == before["last_active"]
    assert after["idle_seconds"] > before["idle_seconds"]
    await service.stop()


async def test_access_control(hub_factory, tmp_path):
    service = GpuSnapService(
        tmp_path / "gpusnap", SETTINGS.replace("idle_window = 6", "idle_window = 3600")
    )
    hub = await hub_factory(service.hub_config())
    await hub.start_server("alice")
    await hub.start_server("bob")
    await service.start(hub)

    async def both_seen():
        code, data = await service.api("GET", "api/servers")
        return code == 200 and len(data["servers"]) == 2

    await service.wait_for(both_seen, what="both servers listed")
    alice = await hub.user_token("alice")
    # anonymous
    assert (await service.api("GET", "api/servers/alice/", token=""))[0] == 403
    # the owner sees their own server, not bob's, and not the full list
    code, data = await service.api("GET", "api/servers/alice/", token=alice)
    assert code == 200 and data["server"] == "alice/"
    assert (await service.api("GET", "api/servers/bob/", token=alice))[0] == 404
    code, data = await service.api("GET", "api/servers", token=alice)
    assert code == 200 and [s["server"] for s in data["servers"]] == ["alice/"]
    assert (await service.api("POST", "api/servers/bob/keep", {"seconds": 60}, token=alice))[
        0
    ] == 404
    assert (await service.api("GET", "api/events", token=alice))[0] == 403
    assert (await service.api("GET", "metrics", token=alice))[0] == 403
    # keep running: clamped to the admin's maximum (8 h default)
    code, data = await service.api(
        "POST", "api/servers/alice/keep", {"seconds": 10**7}, token=alice
    )
    assert code == 200, data
    keep = datetime.fromisoformat(data["keep_until"].replace("Z", "+00:00")).timestamp()
    assert keep <= datetime.now(timezone.utc).timestamp() + data["max_keep_running"] + 5
    # bad input gets a 400 that says what to send
    code, data = await service.api(
        "POST", "api/servers/alice/keep", {"seconds": "soon"}, token=alice
    )
    assert code == 400 and "seconds" in data["message"]
    code, data = await service.api("POST", "api/servers/alice/keep", b"not json", token=alice)
    assert code == 400
    # a rejected request changes nothing: the keep-running set above stands
    for bad in (b'{"until": NaN}', b'{"seconds": NaN}', b'{"until": Infinity}'):
        code, data = await service.api("POST", "api/servers/alice/keep", bad, token=alice)
        word = "Infinity" if b"Infinity" in bad else "NaN"
        assert code == 400 and f"{word} is not a JSON number" in data["message"], data
        still = await service.server_status("alice/")
        assert still["keep_until"] is not None and still["state"] == "active", (bad, still)
        held = datetime.fromisoformat(still["keep_until"].replace("Z", "+00:00")).timestamp()
        assert held == keep, (bad, still)
    # exempting needs the admin scope
    assert (await service.api("POST", "api/servers/alice/exempt", {}, token=alice))[0] == 403
    code, data = await service.api("POST", "api/servers/alice/exempt", {"exempt": True})
    assert code == 200 and data["exempt"] is True
    # the service's own token is not an admin of gpusnap (nor has it access to the service)
    assert (await service.api("GET", "api/events", token=service.token))[0] == 403
    await service.stop()
