"""The watcher carries out what the policy decided, through its one executor: a tick's park
and warning, and an admin's exemption (asked through the service facade) unparking a parked
server. The Hub and the signals are fakes; the clock is the one thing moved."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timezone
from types import SimpleNamespace

from jupyterhub_gpusnap.model import Sample, Server, State
from jupyterhub_gpusnap.policy import Policy, Rule
from jupyterhub_gpusnap.service import Service
from jupyterhub_gpusnap.store import Store
from jupyterhub_gpusnap.watcher import Watcher

T = 1_800_000_000.0
GIB = 1 << 30
log = logging.getLogger("test")


class Hub:
    def __init__(self, servers: list[Server]):
        self.servers = servers

    async def list_servers(self) -> list[Server]:
        return list(self.servers)


class QuietGpu:
    """Every server quiet, holding GPU memory."""

    name = "fake"
    concurrency = 1

    async def sample(self, server: Server, now: float) -> Sample:
        return Sample(time=now, kernels=1, kernels_busy=0, cpu_percent=0.0, gpu_percent=0.0,
                      gpu_memory_bytes=2 * GIB)  # fmt: skip


async def test_a_tick_parks_and_warns_and_an_exemption_unparks(tmp_path):
    clock = [T]
    alice = Server(
        user="alice", started=datetime.fromtimestamp(T - 2000, timezone.utc), state={"pid": 1}
    )
    store = Store(f"sqlite:///{tmp_path}/gpusnap.sqlite")
    policy = Policy([], Rule(park_window=1800, min_running=0))
    watcher = Watcher(hub=Hub([alice]), store=store, policy=policy, sources=[QuietGpu()], backend=None,
                      clock=lambda: clock[0], log=log)  # fmt: skip
    service = Service(watcher, store, policy, clock=lambda: clock[0])
    calls = []

    async def park(server, status, unpark=False, reason="", detail=None):
        calls.append(("unpark" if unpark else "park", server.key, status.state))
        return SimpleNamespace(bytes_moved=2 * GIB)

    watcher.room.park = park

    await watcher.tick()  # idle 2000 s >= park_window
    assert calls == [("park", "alice/", State.parked)]
    assert store.get("alice/").state == State.parked

    clock[0] = T + 800  # idle 2800 s: the warning, 900 s before idle_window; stays parked
    await watcher.tick()
    assert store.get("alice/").state == State.parked
    kinds = [e["kind"] for e in store.events("alice/")]
    assert kinds.count("warn") == 1 and len(calls) == 1, (kinds, calls)

    status = service.exempt("alice/", True, by="ada")
    assert (status.state, status.exempt, status.reason) == (State.exempt, True, "exempted by ada")
    await asyncio.gather(*watcher._background)
    assert calls[-1] == ("unpark", "alice/", State.exempt)
    [moved] = [e["detail"] for e in store.events("alice/") if e["kind"] == "state"][:1]
    assert (moved["from"], moved["to"]) == ("parked", "exempt")
    assert service.model(store.get("alice/"))["exempt"] is True

    clock[0] = T + 9000  # long past every deadline: exempt, nothing done
    await watcher.tick()
    assert store.get("alice/").state == State.exempt and len(calls) == 2

    status = service.exempt("alice/", False, by="ada")
    assert (status.state, status.exempt) == (State.active, False)
    assert service.model(store.get("alice/"))["exempt"] is False
    store.close()
