"""The jupyter-server extension behind the Lab panel, in a real single-user server.

A real hub spawns alice's server with the extension enabled the way pip enables it (the
jupyter_server_config.d file), next to the real gpusnap service; the tests call the extension
through the proxy with alice's token, as the panel does with her session.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tornado.httpclient import AsyncHTTPClient, HTTPRequest

from jupyterhub_gpusnap.gpu.autounpark import AutoUnpark, kernel_pid
from jupyterhub_gpusnap.gpu.cuda import CudaCheckpoint
from jupyterhub_gpusnap.serverext import service_url_from_env
from tests.helpers.extension_env import jupyter_paths, spawner_environment
from tests.helpers.fake_gpu import CHECKPOINTED, RUNNING, SlowRestoreLibcuda
from tests.helpers.gpusnap_service import GpuSnapService, stop_recorded
from tests.helpers.kernel_manager import start_cell
from tests.helpers.realhub import free_port

pytestmark = pytest.mark.e2e

SETTINGS = """
c.GpuSnap.interval = 1
c.GpuSnap.idle_window = 3600
c.GpuSnap.min_running = 0
c.GpuSnap.warn_before = 600
c.GpuSnap.max_keep_running = 7200
c.GpuSnap.action = "stop"
"""


@pytest.fixture
async def hub_and_service(hub_factory, tmp_path):
    service = GpuSnapService(tmp_path / "gpusnap", SETTINGS)
    hub = await hub_factory(
        service.hub_config() + spawner_environment(service, tmp_path / "jupyter")
    )
    await hub.start_server("alice")
    await service.start(hub)
    yield hub, service
    await service.stop()


async def watched(hub, service, user="alice"):
    async def seen():
        code, data = await hub.user_request(user, "gpusnap/status")
        return data if code == 200 else None

    return await service.wait_for(
        seen, what=f"{user}'s server to be watched, through the extension"
    )


async def last_activity(hub, user="alice") -> str:
    code, data = await hub.user_request(user, "api/status?no_track_activity=1")
    assert code == 200, data
    return data["last_activity"]


async def test_status_keep_suspend_and_no_activity_through_the_extension(hub_and_service):
    hub, service = hub_and_service
    status = await watched(hub, service)
    assert status["server"] == "alice/"
    assert status["state"] in ("active", "idle"), status
    assert status["running"] is True
    assert status["max_keep_running"] == 7200
    assert isinstance(status["events"], list)
    assert "kernels" in status["signals"]
    # the automatic unpark's state rides along (no CUDA driver here: nothing is watched)
    assert status["autounpark"]["watching"] is False
    assert status["autounpark"]["resuming"] is False

    # the panel's polling is not activity: /api/status's last_activity does not move
    before = await last_activity(hub)
    for _ in range(25):
        code, data = await hub.user_request("alice", "gpusnap/status")
        assert code == 200, data
        code, data = await hub.user_request("alice", "gpusnap/autounpark")
        assert code == 200 and data["resuming"] is False, data
    code, _ = await hub.user_request("alice", "gpusnap/keep", "POST", {"seconds": 60})
    assert code == 200
    assert await last_activity(hub) == before
    # the same check does see real API use, so it can fail
    code, _ = await hub.user_request("alice", "api/contents")
    assert code == 200
    assert await last_activity(hub) != before

    # keep running, clamped by the service to the admin's maximum
    code, kept = await hub.user_request("alice", "gpusnap/keep", "POST", {"seconds": 10**6})
    assert code == 200, kept
    assert kept["keep_until"] is not None
    direct = await service.server_status("alice/")
    assert direct["keep_until"] == kept["keep_until"]

    # the service's own 400 comes back with its message
    code, bad = await hub.user_request("alice", "gpusnap/keep", "POST", {"seconds": "soon"})
    assert code == 400 and "seconds" in bad["message"], bad

    # without a login the extension refuses, like any jupyter-server API
    code, _ = await hub.user_request("alice", "gpusnap/status", token="not-a-token")
    assert code in (302, 403), code
    # bob may not use alice's server (the Hub's own access rules)
    bob = await hub.user_token("bob")
    code, _ = await hub.user_request("alice", "gpusnap/status", token=bob)
    assert code in (302, 403, 404), code

    # suspend now: with action "stop" the service stops the server
    code, data = await hub.user_request("alice", "gpusnap/suspend", "POST", {})
    assert code == 202, data

    async def stopped():
        return await hub.get_server("alice") is None

    await service.wait_for(stopped, what="alice's server to stop after suspend-now")
    await service.wait_for(lambda: stop_recorded(service, "alice/"), what="the stop to be recorded")


async def test_unreachable_service_names_the_fix(hub_factory, tmp_path):
    hub = await hub_factory(
        "c.Spawner.environment = "
        + repr(
            {
                **jupyter_paths(tmp_path / "jupyter"),
                "GPUSNAP_SERVICE_URL": "http://127.0.0.1:9/services/gpusnap/",
            }
        )
    )
    await hub.start_server("alice")
    code, data = await hub.user_request("alice", "gpusnap/status")
    assert code == 502
    assert "GPUSNAP_SERVICE_URL" in data["message"] and data["server"] == "alice/"


def test_service_url_from_env():
    assert service_url_from_env({"GPUSNAP_SERVICE_URL": "http://x:1/s/g"}) == "http://x:1/s/g/"
    assert (
        service_url_from_env(
            {
                "JUPYTERHUB_PUBLIC_URL": "https://hub.example.org/",
                "JUPYTERHUB_API_URL": "http://hub:8081/hub/api",
            }
        )
        == "https://hub.example.org/services/gpusnap/"
    )
    assert (
        service_url_from_env({"JUPYTERHUB_API_URL": "http://proxy:8000/hub/api"}, "snap")
        == "http://proxy:8000/services/snap/"
    )
    # JUPYTERHUB_PUBLIC_URL is the server's own public URL: only its host counts
    assert (
        service_url_from_env(
            {
                "JUPYTERHUB_PUBLIC_URL": "https://hub.example.org/jh/user/alice/gpu/",
                "JUPYTERHUB_BASE_URL": "/jh/",
                "JUPYTERHUB_API_URL": "http://hub:8081/jh/hub/api",
            }
        )
        == "https://hub.example.org/jh/services/gpusnap/"
    )


@pytest.fixture
async def jupyter_server(tmp_path, monkeypatch):
    """A real jupyter-server in this process with only the gpusnap extension, outside
    JupyterHub; yields (app, base url, token)."""
    from jupyter_server.serverapp import ServerApp

    for name in ("JUPYTERHUB_USER", "JUPYTERHUB_API_TOKEN", "JUPYTERHUB_SERVER_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JUPYTER_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    port = free_port()
    token = secrets.token_hex(16)
    app = ServerApp(jpserver_extensions={"jupyterhub_gpusnap.serverext": True})
    app.initialize(
        argv=[
            f"--port={port}",
            "--ip=127.0.0.1",
            "--allow-root",
            "--no-browser",
            f"--ServerApp.root_dir={tmp_path}",
            f"--IdentityProvider.token={token}",
        ]
        + [
            f"--ServerApp.jpserver_extensions={name}={enabled}"
            for name, enabled in [
                ("jupyterhub_gpusnap.serverext", True),
                ("jupyterlab", False),
                ("jupyter_lsp", False),
                ("notebook_shim", False),
                ("jupyter_server_terminals", False),
            ]
        ],
        new_httpserver=True,
    )
    app.start_app()
    try:
        yield app, f"http://127.0.0.1:{port}/", token
    finally:
        await app._cleanup()
        ServerApp.clear_instance()


async def local_get(base: str, token: str, path: str) -> tuple[int, dict]:
    resp = await AsyncHTTPClient().fetch(
        HTTPRequest(base + path, headers={"Authorization": f"token {token}"}),
        raise_error=False,
    )
    return resp.code, json.loads(resp.body) if resp.body else {}


async def test_resuming_is_shown_while_a_busy_parked_kernel_gets_its_gpu_memory_back(
    jupyter_server,
):
    app, base, token = jupyter_server
    # no CUDA driver here: the extension watches nothing, and says so
    code, state = await local_get(base, token, "gpusnap/autounpark")
    assert code == 200 and state["watching"] is False and state["resuming"] is False
    code, _ = await local_get(base, "not-the-token", "gpusnap/autounpark")
    assert code == 403

    # a real kernel, parked on the (fake) driver; auto-unpark watching it as it does on a GPU
    code, kernel = await post_json(base, token, "api/kernels", {})
    assert code == 201, kernel
    km = app.kernel_manager
    pid = kernel_pid(km.get_kernel(kernel["id"]))
    driver = SlowRestoreLibcuda([pid])
    driver.states[pid] = CHECKPOINTED
    watcher = AutoUnpark(km, cuda=CudaCheckpoint(driver=driver), interval=0.05)
    app.web_app.settings["gpusnap_autounpark"] = watcher
    watcher.start()
    client = None
    try:
        code, state = await local_get(base, token, "gpusnap/autounpark")
        assert code == 200 and state["watching"] is True and state["resuming"] is False

        client = await start_cell(
            km, kernel["id"], "import time; time.sleep(5)"
        )  # the user runs a cell
        for _ in range(400):
            if driver.restoring.is_set():
                break
            await asyncio.sleep(0.05)
        assert driver.restoring.is_set(), "the busy parked kernel was not unparked"
        code, state = await local_get(base, token, "gpusnap/autounpark")
        assert code == 200 and state["resuming"] is True, state
        assert state["resuming_kernels"] == [kernel["id"]] and state["resuming_since"]
        # the status carries it too, even where the service cannot be asked (not under a Hub)
        code, status = await local_get(base, token, "gpusnap/status")
        assert code == 404 and "JUPYTERHUB_USER" in status["message"]
        assert status["autounpark"]["resuming"] is True

        driver.go.set()
        for _ in range(200):
            code, state = await local_get(base, token, "gpusnap/autounpark")
            if not state["resuming"]:
                break
            await asyncio.sleep(0.05)
        assert state["resuming"] is False and state["last_unpark"]["kernel"] == kernel["id"]
        assert driver.states[pid] == RUNNING
    finally:
        driver.go.set()
        watcher.stop()
        if client is not None:
            client.stop_channels()


async def post_json(base: str, token: str, path: str, body: dict) -> tuple[int, dict]:
    resp = await AsyncHTTPClient().fetch(
        HTTPRequest(
            base + path,
            method="POST",
            body=json.dumps(body),
            headers={"Authorization": f"token {token}"},
        ),
        raise_error=False,
    )
    return resp.code, json.loads(resp.body) if resp.body else {}


def stand_in_driver(root: Path) -> Path:
    """A real shared library under a name nothing else loads, as CudaCheckpoint.libcuda_path: a
    process that tries to load the CUDA driver maps it (and finds no checkpoint API in it)."""
    import ctypes.util

    name = ctypes.util.find_library("z")
    source = next(
        p
        for d in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/lib64")
        if (p := Path(d) / name).exists()
    )
    path = root / "libcuda-stand-in.so.1"
    shutil.copy(source, path)
    return path


async def test_the_extension_loads_nothing_of_the_gpu_until_the_service_says_parked(tmp_path):
    driver = stand_in_driver(tmp_path)
    port, token = free_port(), secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTERHUB_")}
    env.update(
        JUPYTER_CONFIG_DIR=str(tmp_path / "config"), JUPYTER_RUNTIME_DIR=str(tmp_path / "rt")
    )
    log = open(tmp_path / "server.log", "wb")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter_server",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}",
            "--ServerApp.open_browser=False",
            "--ServerApp.allow_root=True",
            f"--ServerApp.root_dir={tmp_path}",
            "--ServerApp.jpserver_extensions=jupyterhub_gpusnap.serverext=True",
            f"--CudaCheckpoint.libcuda_path={driver}",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    try:
        base = f"http://127.0.0.1:{port}/"
        for _ in range(300):
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            try:
                code, state = await local_get(base, token, "gpusnap/autounpark")
                if code == 200:
                    break
            except OSError:
                pass
            await asyncio.sleep(0.2)
        assert code == 200 and state["watching"] is False, state
        # a kernel too: the server at work, still no driver
        code, _ = await post_json(base, token, "api/kernels", {})
        assert code == 201
        maps = Path(f"/proc/{server.pid}/maps").read_text()
        assert str(driver) not in maps, "the server extension loaded the (stand-in) CUDA driver"
        assert "libnvidia-ml" not in maps and "libcuda.so" not in maps
        log_text = (tmp_path / "server.log").read_text()
        assert "jupyterhub_gpusnap.serverext | extension was successfully loaded" in log_text
    finally:
        server.terminate()
        server.wait(30)
        log.close()


async def test_a_parked_answer_from_the_service_starts_the_automatic_unpark(jupyter_server):
    app, base, token = jupyter_server
    settings = app.web_app.settings
    assert settings.get("gpusnap_autounpark") is None
    settings["gpusnap_on_status"]({"state": "active"})
    assert settings.get("gpusnap_autounpark") is None
    settings["gpusnap_on_status"]({"state": "parked"})
    watcher = settings["gpusnap_autounpark"]
    assert isinstance(watcher, AutoUnpark) and watcher.cuda._loaded  # it looked for the driver
    code, state = await local_get(base, token, "gpusnap/autounpark")
    assert code == 200 and state["watching"] is False  # none here: nothing to watch
