"""Fault: the manifest of a suspended server's verified checkpoint is deleted.

Without ``manifest.json`` a checkpoint cannot be verified (the checksums are in it) nor
resumed with its Hub token, so it must not be restored. What must happen instead, with a
real Hub, the Snap spawner, a real kernel and real CRIU:

- the user's next spawn does not fail: a fresh server starts, and the progress page says
  the snapshot could not be found and that the admin can still recover it;
- the Hub log names the checkpoint, says a fresh server was started and that its files
  stay on disk for recovery by hand (docs/operations.md);
- the image files are left alone, by the spawn and by retention;
- the service's watcher does not report the fresh start as a restore: it records a failed
  restore (event, metrics), so the user's one email is accurate.
"""

from __future__ import annotations

import asyncio

import pytest

from jupyterhub_gpusnap import metrics
from jupyterhub_gpusnap.checkpoint.manifest import MANIFEST
from jupyterhub_gpusnap.hub import HubClient
from jupyterhub_gpusnap.model import State
from jupyterhub_gpusnap.policy import Policy, Rule, ServerStatus
from jupyterhub_gpusnap.store import Store
from jupyterhub_gpusnap.watcher import Watcher
from tests.helpers.local_hub import ProgressReader, service_backend, snap_config, suspend

pytestmark = [pytest.mark.faults, pytest.mark.e2e, pytest.mark.criu]


def counter(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


async def test_deleted_manifest_starts_fresh_and_keeps_the_image(hub_factory, tmp_path):
    ckpt = tmp_path / "ckpt"
    # the spawn request returns at once (202), so that its progress can be followed
    hub = await hub_factory(
        snap_config(ckpt, 'c.JupyterHub.tornado_settings = {"slow_spawn_timeout": 0}')
    )
    backend = service_backend(ckpt)
    await hub.start_server("alice")
    kid, out = await hub.execute("alice", "x = 42\nprint('set')")
    assert out.strip() == "set"
    _, old_token = await hub.execute(
        "alice", "import os; print(os.environ['JUPYTERHUB_API_TOKEN'])"
    )
    old_token = old_token.strip()
    assert (await hub.api("GET", "/user", token=old_token))[0] == 200

    info = await suspend(hub, backend, "alice")
    folder = backend.folder(info.id)
    # the service's record of the suspension, as its watcher keeps it
    store = Store(f"sqlite:///{tmp_path / 'gpusnap.sqlite'}")
    store.put(
        ServerStatus(
            key="alice/",
            user="alice",
            state=State.suspended,
            state_since=info.created,
            last_active=info.created - 3600,
            started=info.created - 7200,
            checkpoint_id=info.id,
        ),
        now=True,
    )
    image = sorted(p.name for p in folder.iterdir() if p.name.endswith(".img"))
    assert image and (folder / MANIFEST).exists()

    (folder / MANIFEST).unlink()  # the fault

    status, _ = await hub.api("POST", "/users/alice/server", {})
    assert status == 202
    progress = ProgressReader(hub, "alice")
    model = await hub.wait_ready("alice")
    await asyncio.wait_for(progress.done, 30)
    assert model["ready"]

    # a fresh server: the old kernel is gone, a new one works
    code, kernels = await hub.user_request("alice", "api/kernels")
    assert code == 200 and kernels == []
    _, out = await hub.execute("alice", "print('fresh')")
    assert out.strip() == "fresh"
    # the suspended server's token, kept only in the lost manifest, no longer works
    assert (await hub.api("GET", "/user", token=old_token))[0] == 403, hub.log_tail()

    # the user and the admin are told, and the image stays for recovery by hand
    messages = progress.messages()
    assert "snapshot" in messages and "fresh server" in messages, messages
    log = hub.log_text()
    assert f"alice/: checkpoint {info.id} is gone" in log
    assert "recovery by hand" in log and str(folder) in log, hub.log_tail()
    assert sorted(p.name for p in folder.iterdir() if p.name.endswith(".img")) == image
    assert await backend.apply_retention() == []
    assert sorted(p.name for p in folder.iterdir() if p.name.endswith(".img")) == image
    assert await backend.latest("alice", "") is None and await backend.get(info.id) is None

    # the service sees the server back, and does not call it restored
    restored_ok = counter("gpusnap_actions_total", action="restore", result="ok")
    restore_failed = counter("gpusnap_actions_total", action="restore", result="failed")
    rule = Rule(name="default", idle_window=3600, warn_before=0, min_running=600)
    watcher = Watcher(
        hub=HubClient(api_url=hub.hub_api_url, api_token=hub.admin_token),
        store=store,
        policy=Policy(rules=[], default=rule),
        sources=[],
        backend=backend,
    )
    try:
        await watcher.tick()
        status = store.get("alice/")
        assert status.state in (State.active, State.idle) and status.restored_at, status
        kinds = [e["kind"] for e in store.events("alice/")]
        assert "restore_failed" in kinds and "restore" not in kinds, kinds
        assert status.failure, status
        assert (
            counter("gpusnap_actions_total", action="restore", result="failed")
            == restore_failed + 1
        )
        assert counter("gpusnap_actions_total", action="restore", result="ok") == restored_ok
    finally:
        store.close()
