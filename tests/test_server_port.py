"""The port a new single-user server listens on comes from just below the kernel's
ephemeral range, where no Jupyter kernel's ZeroMQ socket and no outgoing connection can
take it between the spawner's pick and the server's bind (which once made a spawn fail:
the server exited with "Address already in use" and the Hub read ZeroMQ on its port)."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import pytest

from jupyterhub_gpusnap import procs
from tests.helpers.local_hub import snap_config


def span() -> range:
    high = procs.ephemeral_low()
    return range(max(1024, high - procs.SERVER_PORTS), high)


def test_the_pick_is_below_the_ephemeral_range_and_free():
    for _ in range(20):
        port = procs.server_port("127.0.0.1")
        assert port in span()
        assert procs.can_listen("127.0.0.1", port)


def test_the_pick_skips_a_port_something_listens_on_and_a_reserved_one(monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    busy = held.getsockname()[1]
    reserved, free = span()[10], span()[11]
    assert procs.can_listen("127.0.0.1", free)
    picks = iter([busy, reserved, free])
    monkeypatch.setattr(procs.random, "randrange", lambda a, b: next(picks))
    try:
        assert not procs.can_listen("127.0.0.1", busy)
        assert procs.server_port("127.0.0.1", {reserved}) == free
    finally:
        held.close()


def test_an_ephemeral_range_from_1024_up_leaves_the_pick_to_the_kernel(monkeypatch):
    monkeypatch.setattr(procs, "ephemeral_low", lambda: 1024)
    port = procs.server_port("127.0.0.1", {1})
    assert port >= 1024 and procs.can_listen("127.0.0.1", port)


@pytest.mark.e2e
async def test_a_spawned_server_listens_below_the_ephemeral_range(hub_factory, tmp_path):
    hub = await hub_factory(snap_config(tmp_path / "ckpt"))
    model = await hub.start_server("alice")
    port = urlsplit(model["state"]["gpusnap_url"]).port
    assert port in span(), (port, model)
    status, _ = await hub.user_request("alice", "/api/status")
    assert status == 200
