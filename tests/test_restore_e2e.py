"""End to end with a real Hub, proxy, single-user servers, kernels and CRIU.

The test plays the service's part exactly as the service does it: checkpoint through
LocalBackend, then stop the server through the Hub API. The user comes back through
the proxy with their own token and finds the same kernel with the same variables.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from tornado.httpclient import AsyncHTTPClient, HTTPRequest

from jupyterhub_gpusnap.checkpoint.manifest import Manifest
from jupyterhub_gpusnap.model import Server
from tests.helpers.local_hub import ProgressReader, service_backend, snap_config, suspend
from tests.helpers.realhub import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.criu]


@pytest.mark.parametrize("storage", ["files", "chunks"])
async def test_suspended_server_comes_back_with_its_kernel(hub_factory, tmp_path, storage):
    """``chunks``: the image is kept as compressed chunks and CRIU restores it through the
    streamer (``criu restore --stream``) — a real Jupyter server with its kernel and files."""
    ckpt = tmp_path / "ckpt"
    hub = await hub_factory(snap_config(ckpt, f"c.LocalBackend.storage = {storage!r}"))
    backend = service_backend(ckpt, storage=storage)
    await hub.start_server("alice")
    kid, out = await hub.execute(
        "alice", "x = 42\nf = open('notes.txt', 'a')\nf.write('before\\n'); f.flush()\nprint('ok')"
    )
    assert out.strip() == "ok"
    first_pid = (await hub.get_server("alice"))["state"]["pid"]

    info = await suspend(hub, backend, "alice")
    assert info.extra["port"] and "alice/: suspended (checkpoint" in hub.log_text()
    # the page a returning user sees
    token = await hub.user_token("alice")
    resp = await AsyncHTTPClient().fetch(
        HTTPRequest(hub.url + "hub/user/alice/", headers={"Authorization": f"token {token}"}),
        raise_error=False,
    )
    page = resp.body.decode()
    assert resp.code == 424
    assert "Your server is suspended" in page and "to free the GPU" in page
    assert "Restore server" in page

    await hub.start_server("alice")
    kid2, out = await hub.execute(
        "alice", "f.write('after\\n'); f.flush()\nprint(x)", kernel_id=kid
    )
    assert kid2 == kid and out.strip() == "42"
    assert (hub.home_root / "alice" / "notes.txt").read_text() == "before\nafter\n"
    model = await hub.get_server("alice")
    assert model["ready"] and model["state"]["pid"] != first_pid
    m = Manifest.load(backend.folder(info.id))
    assert m.status == "restored" and m.storage == storage
    assert "alice/: restored from" in hub.log_text()
    if storage == "chunks":
        (log,) = backend.folder(info.id).glob("restore-*.log")  # CRIU's log is kept
        assert "Dismissing the image streamer" in log.read_text()  # it read through the streamer
        assert not list(backend.folder(info.id).glob("*.img")), "the image stays chunks only"
        return  # the rest is storage-independent
    # the server's own calls to the Hub work: its old token was taken back
    status, data = await hub.user_request("alice", "api/status")
    assert status == 200 and data["kernels"] == 1
    # and a browser gets in through the server's OAuth client (re-registered on restore)
    browser = await hub.browser("alice")
    resp = await browser.request("/user/alice/files/notes.txt")
    assert resp.code == 200 and resp.body == b"before\nafter\n", browser.history
    assert any("oauth_callback" in url for _, url in browser.history)
    resp = await browser.request("/user/alice/api/kernels")
    assert resp.code == 200 and [k["id"] for k in json.loads(resp.body)] == [kid]
    browser.close()

    # suspended a second time, from the restored state, and the Hub restarts meanwhile
    await suspend(hub, backend, "alice")
    await hub.restart()
    await hub.start_server("alice")
    _, out = await hub.execute("alice", "x + 1", kernel_id=kid)
    assert out == "43"
    # a plain stop (no checkpoint) is an ordinary stop: the next start is fresh
    await hub.stop_server("alice")
    await hub.start_server("alice")
    status, kernels = await hub.user_request("alice", "api/kernels")
    assert status == 200 and kernels == []


async def test_failed_restore_starts_fresh_and_keeps_the_image(hub_factory, tmp_path):
    ckpt = tmp_path / "ckpt"
    # the spawn request returns at once (202), so that progress can be followed
    hub = await hub_factory(
        snap_config(ckpt, 'c.JupyterHub.tornado_settings = {"slow_spawn_timeout": 0}')
    )
    backend = service_backend(ckpt)
    await hub.start_server("bob")
    kid, _ = await hub.execute("bob", "x = 42")
    info = await suspend(hub, backend, "bob")
    folder = backend.folder(info.id)
    pages = max(folder.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    data = bytearray(pages.read_bytes())
    data[100] ^= 0x55
    pages.write_bytes(bytes(data))

    status, _ = await hub.api("POST", "/users/bob/server", {})
    assert status == 202
    progress = ProgressReader(hub, "bob")
    await hub.wait_ready("bob")
    await asyncio.wait_for(progress.done, 30)
    assert "could not restore your snapshot" in progress.messages()
    assert "damaged" in progress.messages()

    m = Manifest.load(folder)
    assert m.status == "failed" and "damaged" in m.error and pages.name in m.error
    # the token the image holds is revoked: that image will never run again
    assert m.api_token
    status, _ = await hub.api("GET", "/user", token=m.api_token)
    assert status == 403
    assert (folder / pages.name).exists()  # kept for diagnosis
    assert "bob/: restore of checkpoint" in hub.log_text()
    # a fresh server: the old kernel is gone, a new one works
    status, kernels = await hub.user_request("bob", "api/kernels")
    assert status == 200 and kernels == []
    _, out = await hub.execute("bob", "print('fresh')")
    assert out.strip() == "fresh"


async def test_stop_during_a_suspension_waits_for_it(hub_factory, tmp_path):
    ckpt = tmp_path / "ckpt"
    port = free_port()
    # every fresh server asks for the same port: the suspended one's must not be handed out
    hub = await hub_factory(
        snap_config(
            ckpt,
            f'c.JupyterHub.tornado_settings = {{"slow_stop_timeout": 1}}\nc.Spawner.port = {port}'
            "\nc.JupyterHub.allow_named_servers = True",
        )
    )
    go = tmp_path / "go"
    hook = tmp_path / "hook.sh"
    hook.write_text(
        '#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0\n'
        f"while [ ! -e {go} ]; do sleep 0.05; done\n"
    )
    hook.chmod(0o700)
    backend = service_backend(ckpt, dump_extra_args=["--action-script", str(hook)])
    # a named server: carol/gpu
    await hub.start_server("carol", "gpu")
    kid, _ = await hub.execute("carol", "x = 42", server="gpu")
    model = await hub.get_server("carol", "gpu")

    suspension = asyncio.ensure_future(
        backend.checkpoint(Server(user="carol", name="gpu", state=model["state"]))
    )
    while await backend.writing("carol", "gpu") is None:
        await asyncio.sleep(0.05)
    # someone stops the server while its image is being written: the stop must wait,
    # never kill the frozen processes under CRIU's feet
    status, _ = await hub.api("DELETE", "/users/carol/servers/gpu")
    assert status == 202
    assert (await hub.get_server("carol", "gpu"))["pending"] == "stop"
    assert "carol/gpu: stop waits for the suspension being written" in hub.log_text()
    go.touch()
    info = await suspension
    assert info.status == "verified"
    for _ in range(200):
        if await hub.get_server("carol", "gpu") is None:
            break
        await asyncio.sleep(0.1)
    assert await hub.get_server("carol", "gpu") is None
    assert "carol/gpu: suspended (checkpoint" in hub.log_text()

    assert info.extra["port"] == port  # carol had the configured port
    await hub.start_server("dave")
    status, routes = await hub.api("GET", "/proxy")
    assert status == 200
    assert not routes["/user/dave/"]["target"].endswith(f":{port}")
    await hub.start_server("carol", "gpu")
    _, out = await hub.execute("carol", "x", kernel_id=kid, server="gpu")
    assert out == "42"
    _, out = await hub.execute("dave", "print('dave')")
    assert out.strip() == "dave"


async def test_a_missing_encryption_key_keeps_the_snapshot_until_it_is_back(hub_factory, tmp_path):
    """The key that sealed a snapshot is missing from the key file (rotated away too early):
    the spawn fails naming the key and the fix, the snapshot stays verified, and once the key
    is back the next start restores the same kernel (it was marked failed and lost)."""
    from jupyterhub_gpusnap.checkpoint.keys import new_key_line

    ckpt = tmp_path / "ckpt"
    keys = tmp_path / "keys"
    keys.write_text(new_key_line("k1") + "\n")
    keys.chmod(0o600)
    original = keys.read_text()
    settings = (
        f'c.LocalBackend.storage = "chunks"\nc.LocalBackend.encryption_key_file = {str(keys)!r}\n'
    )
    hub = await hub_factory(snap_config(ckpt, settings))
    backend = service_backend(ckpt, storage="chunks", encryption_key_file=str(keys))
    await hub.start_server("alice")
    kid, _ = await hub.execute("alice", "x = 42")
    info = await suspend(hub, backend, "alice")

    keys.write_text(new_key_line("k2") + "\n")  # k1 dropped: the snapshot cannot be opened
    status, data = await hub.api("POST", "/users/alice/server")
    assert status in (201, 202, 500), data  # 500: the spawn failed before the API answered

    async def spawn_failed():
        return await hub.get_server("alice") is None and "cannot restore" in hub.log_text()

    for _ in range(300):
        if await spawn_failed():
            break
        await asyncio.sleep(0.1)
    assert await spawn_failed(), hub.log_tail()
    log = hub.log_text()
    assert "'k1'" in log and "encryption_key_file" in log, hub.log_tail()
    assert Manifest.load(backend.folder(info.id)).status == "verified"  # not failed, not lost

    keys.write_text(original)  # the admin puts the key back
    await hub.start_server("alice")
    kid2, out = await hub.execute("alice", "print(x)", kernel_id=kid)
    assert kid2 == kid and out.strip() == "42"
    assert Manifest.load(backend.folder(info.id)).status == "restored"
