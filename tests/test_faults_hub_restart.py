"""Fault: the Hub goes down in the middle of a suspension.

The service checkpoints a server (verified, processes ended) while the Hub is down, so its
"stop this server" call cannot reach the Hub. When the Hub comes back, its start-up poll of
the spawner finds the server's process gone and the spawner sees why: a verified checkpoint
of that very run. The server ends up stopped-and-restorable, never neither: the user's next
spawn restores the same kernel with the same variables. Real Hub, proxy, Snap spawner,
kernel and CRIU.
"""

from __future__ import annotations

import pytest
from test_restore_e2e import service_backend, snap_config

from jupyterhub_gpusnap.checkpoint.local import is_alive
from jupyterhub_gpusnap.checkpoint.manifest import Manifest
from jupyterhub_gpusnap.model import Server

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
