"""Make room on demand: park idle servers, the longest idle first, until enough GPU memory is free.

Real processes stand in for the servers; the CUDA driver and NVML are the ctypes-level fakes
of tests/test_cuda_absent.py (no GPU here; tests/test_gpu_park.py parks on a real GPU).
"""

from __future__ import annotations

import logging
import subprocess
import time

import pytest
from test_cuda_absent import CHECKPOINTED, RUNNING, FakeLibcuda, FakeNvmlLib

from jupyterhub_gpusnap.checkpoint.cuda import CudaCheckpoint
from jupyterhub_gpusnap.model import Server, State
from jupyterhub_gpusnap.policy import Policy, Rule, ServerStatus
from jupyterhub_gpusnap.signals.nvml import Nvml
from jupyterhub_gpusnap.store import Store
from jupyterhub_gpusnap.watcher import Watcher

GiB = 1024**3
log = logging.getLogger("test")


@pytest.fixture
def three():
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    yield [p.pid for p in procs]
    for p in procs:
        p.kill()
        p.wait()


def watcher_with(tmp_path, pids, states, idle_since):
    store = Store(f"sqlite:///{tmp_path}/gpusnap.sqlite")
    watcher = Watcher(hub=None, store=store, policy=Policy([], Rule()), sources=[], backend=None, log=log)
    driver = FakeLibcuda(pids)
    nvml = Nvml(FakeNvmlLib([{"name": "NVIDIA H100", "procs": {p: 4 * GiB for p in pids}, "samples": [], "util": 0}]))
    watcher._cuda = CudaCheckpoint(driver=driver, nvml=nvml, log=log)
    now = time.time()
    for user, pid, state, since in zip(("alice", "bob", "carol"), pids, states, idle_since, strict=True):
        server = Server(user=user, state={"pid": pid})
        watcher.servers[server.key] = server
        store.put(ServerStatus(key=server.key, user=user, state=state, state_since=now, last_active=now - since,
                               started=now - 3600, last_sample={"gpu_memory_bytes": 4 * GiB}))
    return watcher, driver


async def test_parks_the_longest_idle_first_until_enough_is_free(tmp_path, three):
    alice, bob, carol = three
    watcher, driver = watcher_with(tmp_path, three, [State.idle, State.warned, State.active], [300, 900, 0])
    result = await watcher.make_room(5 * GiB)
    assert result["parked"] == ["bob/", "alice/"]  # bob has been idle longest
    assert result["freed_bytes"] == 8 * GiB and result["enough"]
    assert driver.states[bob] == CHECKPOINTED and driver.states[alice] == CHECKPOINTED
    assert driver.states[carol] == RUNNING  # the active server is never parked
    assert watcher.store.get("bob/").state == State.parked
    kinds = [e["kind"] for e in watcher.store.events("bob/")]
    assert "park" in kinds


async def test_stops_as_soon_as_enough_and_says_when_it_is_not(tmp_path, three):
    alice, bob, carol = three
    watcher, driver = watcher_with(tmp_path, three, [State.idle, State.idle, State.exempt], [300, 900, 9999])
    result = await watcher.make_room(3 * GiB)
    assert result["parked"] == ["bob/"] and result["enough"]
    assert driver.states[alice] == RUNNING
    # more than the idle servers hold: parks what it can and says it was not enough
    result = await watcher.make_room(64 * GiB)
    assert result["parked"] == ["alice/"] and not result["enough"]
    assert driver.states[carol] == RUNNING  # exempt
