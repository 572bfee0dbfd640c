"""Make room: park idle servers, the longest idle first, until enough GPU memory is free.

On demand (the admin API) and by itself each tick (``Watcher.min_free_gpu_memory``, per GPU).
Real processes stand in for the servers; the CUDA driver and NVML are the ctypes-level fakes
of tests/helpers/fake_gpu.py (no GPU here; tests/test_gpu_park.py parks on a real GPU).
"""

from __future__ import annotations

import logging
import subprocess
import time

import pytest
from traitlets import TraitError

from jupyterhub_gpusnap.gpu.cuda import CudaCheckpoint
from jupyterhub_gpusnap.gpu.nvml import Nvml
from jupyterhub_gpusnap.model import Server, State
from jupyterhub_gpusnap.policy import Policy, Rule, ServerStatus
from jupyterhub_gpusnap.store import Store
from jupyterhub_gpusnap.watcher import Watcher
from tests.helpers.fake_gpu import CHECKPOINTED, RUNNING, FakeLibcuda, FakeNvmlLib, SharedGpus, U
from tests.helpers.metrics import metric

GiB = 1024**3
log = logging.getLogger("test")


@pytest.fixture
def three(sleepers):
    return sleepers(3)


def watcher_with(tmp_path, pids, states, idle_since):
    store = Store(f"sqlite:///{tmp_path}/gpusnap.sqlite")
    watcher = Watcher(
        hub=None, store=store, policy=Policy([], Rule()), sources=[], backend=None, log=log
    )
    driver = FakeLibcuda(pids)
    nvml = Nvml(
        FakeNvmlLib(
            [{"name": "NVIDIA H100", "procs": {p: 4 * GiB for p in pids}, "samples": [], "util": 0}]
        )
    )
    watcher.room._cuda = CudaCheckpoint(driver=driver, nvml=nvml, log=log)
    now = time.time()
    for user, pid, state, since in zip(
        ("alice", "bob", "carol"), pids, states, idle_since, strict=True
    ):
        server = Server(user=user, state={"pid": pid})
        watcher.servers[server.key] = server
        store.put(
            ServerStatus(
                key=server.key,
                user=user,
                state=state,
                state_since=now,
                last_active=now - since,
                started=now - 3600,
                last_sample={"gpu_memory_bytes": 4 * GiB},
            )
        )
    return watcher, driver


async def test_parks_the_longest_idle_first_until_enough_is_free(tmp_path, three):
    alice, bob, carol = three
    watcher, driver = watcher_with(
        tmp_path, three, [State.idle, State.warned, State.active], [300, 900, 0]
    )
    result = await watcher.room.make_room(5 * GiB)
    assert result["parked"] == ["bob/", "alice/"]  # bob has been idle longest
    assert result["freed_bytes"] == 8 * GiB and result["enough"]
    assert driver.states[bob] == CHECKPOINTED and driver.states[alice] == CHECKPOINTED
    assert driver.states[carol] == RUNNING  # the active server is never parked
    assert watcher.store.get("bob/").state == State.parked
    kinds = [e["kind"] for e in watcher.store.events("bob/")]
    assert "park" in kinds


async def test_stops_as_soon_as_enough_and_says_when_it_is_not(tmp_path, three):
    alice, bob, carol = three
    watcher, driver = watcher_with(
        tmp_path, three, [State.idle, State.idle, State.exempt], [300, 900, 9999]
    )
    result = await watcher.room.make_room(3 * GiB)
    assert result["parked"] == ["bob/"] and result["enough"]
    assert driver.states[alice] == RUNNING
    # more than the idle servers hold: parks what it can and says it was not enough
    result = await watcher.room.make_room(64 * GiB)
    assert result["parked"] == ["alice/"] and not result["enough"]
    assert driver.states[carol] == RUNNING  # exempt


# --- min_free_gpu_memory: make room by itself, each tick ---------------------------------------


@pytest.fixture
def five():
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(5)]
    yield [p.pid for p in procs]
    for p in procs:
        p.kill()
        p.wait()


def shared_watcher(tmp_path, servers, devices, **traits):
    """A watcher over ``servers`` (user, pid, state, idle seconds) on fake GPUs ``devices``."""
    store = Store(f"sqlite:///{tmp_path}/gpusnap.sqlite")
    watcher = Watcher(hub=None, store=store, policy=Policy([], Rule()), sources=[], backend=None, log=log,
                      **traits)  # fmt: skip
    driver = FakeLibcuda([pid for _, pid, _, _ in servers])
    nvml = Nvml(SharedGpus(driver, devices))
    watcher.room._cuda = CudaCheckpoint(driver=driver, nvml=nvml, log=log)
    now = time.time()
    for user, pid, state, idle in servers:
        server = Server(user=user, state={"pid": pid})
        watcher.servers[server.key] = server
        held = sum(d["procs"].get(pid, 0) for d in devices)
        store.put(ServerStatus(key=server.key, user=user, state=state, state_since=now, last_active=now - idle,
                               started=now - 7200, last_sample={"gpu_memory_bytes": held}))  # fmt: skip
    return watcher, driver


async def test_min_free_gpu_memory_parks_the_longest_idle_on_the_short_gpu_only(tmp_path, five):
    alice, bob, carol, dave, erin = five
    devices = [
        # GPU 0: 80 - (30 + 30 + 10 + 4) - 1 (someone else's process) = 5 U free
        {"name": "NVIDIA H100", "procs": {alice: 30 * U, bob: 30 * U, carol: 10 * U, erin: 4 * U},
         "other": 1 * U, "samples": [], "util": 0},
        # GPU 1: 60 U free, plenty
        {"name": "NVIDIA H100", "procs": {dave: 20 * U}, "samples": [], "util": 0},
    ]  # fmt: skip
    servers = [
        ("alice", alice, State.idle, 900),
        ("bob", bob, State.warned, 600),
        ("carol", carol, State.active, 0),  # working: never parked
        ("dave", dave, State.idle, 9000),  # idle longest, but on the GPU with room
        ("erin", erin, State.idle, 60),  # idle, but not for min_free_gpu_memory_idle yet
    ]
    watcher, driver = shared_watcher(tmp_path, servers, devices, min_free_gpu_memory=30 * U,
                                     min_free_gpu_memory_idle=300)  # fmt: skip
    runs = metric("gpusnap_make_room_total", trigger="min_free_gpu_memory", result="enough")
    moved = metric("gpusnap_make_room_bytes_total", trigger="min_free_gpu_memory")

    (result,) = await watcher.room.keep_gpu_free()
    # 25 U short on GPU 0: alice (idle longest there) frees 30 U and that is enough
    assert result == {"requested_bytes": 25 * U, "freed_bytes": 30 * U, "parked": ["alice/"],
                      "enough": True, "gpu": 0}  # fmt: skip
    assert driver.states[alice] == CHECKPOINTED
    assert [driver.states[p] for p in (bob, carol, dave, erin)] == [RUNNING] * 4
    status = watcher.store.get("alice/")
    assert status.state == State.parked and "min_free_gpu_memory" in status.reason
    (park,) = [e for e in watcher.store.events("alice/") if e["kind"] == "park"]
    assert park["detail"]["trigger"] == "min_free_gpu_memory" and park["detail"]["gpu"] == 0
    assert park["detail"]["bytes"] == 30 * U
    assert (
        metric("gpusnap_make_room_total", trigger="min_free_gpu_memory", result="enough")
        == runs + 1
    )
    assert metric("gpusnap_make_room_bytes_total", trigger="min_free_gpu_memory") == moved + 30 * U
    assert metric("gpusnap_gpu_free_bytes", node="", gpu="0") == 5 * U
    assert metric("gpusnap_gpu_free_bytes", node="", gpu="1") == 60 * U

    # the next tick finds 35 U free: nothing to do
    assert await watcher.room.keep_gpu_free() == []
    assert metric("gpusnap_gpu_free_bytes", node="", gpu="0") == 35 * U
    assert driver.states[bob] == RUNNING

    # a larger target: bob is next (erin has still not been idle long enough)
    watcher.min_free_gpu_memory = 50 * U
    (result,) = await watcher.room.keep_gpu_free()
    assert result["parked"] == ["bob/"] and result["freed_bytes"] == 30 * U and result["enough"]
    assert driver.states[erin] == RUNNING and driver.states[carol] == RUNNING


async def test_min_free_gpu_memory_never_parks_busy_servers_and_says_once_when_short(
    tmp_path, five, caplog
):
    alice, bob, carol, dave, erin = five
    devices = [{"name": "NVIDIA H100", "procs": {alice: 20 * U, bob: 20 * U, carol: 20 * U, dave: 10 * U,
                                                 erin: 5 * U}, "samples": [], "util": 0}]  # fmt: skip
    servers = [
        # alice: idle by every signal, but a cell is running on the GPU
        ("alice", alice, State.idle, 3600),
        ("bob", bob, State.active, 0),
        ("carol", carol, State.exempt, 9999),
        ("dave", dave, State.idle, 1800),
        ("erin", erin, State.idle, 10),  # too briefly idle
    ]
    watcher, driver = shared_watcher(tmp_path, servers, devices, min_free_gpu_memory=35 * U)
    driver.busy.add(alice)  # the driver lock times out: the GPU is working
    short = metric("gpusnap_make_room_total", trigger="min_free_gpu_memory", result="short")
    refused = metric("gpusnap_actions_total", action="park", result="refused")

    with caplog.at_level(logging.INFO, logger=log.name):
        (result,) = await watcher.room.keep_gpu_free()
        # 5 U free, 30 short: dave is parked, alice refuses (busy), the rest are not candidates
        assert (
            result["parked"] == ["dave/"]
            and result["freed_bytes"] == 10 * U
            and not result["enough"]
        )
        assert driver.states[alice] == RUNNING and driver.states[bob] == RUNNING
        assert driver.states[carol] == RUNNING and driver.states[erin] == RUNNING
        # refused: stays idle, tried again later
        assert watcher.store.get("alice/").state == State.idle
        assert metric("gpusnap_actions_total", action="park", result="refused") == refused + 1
        assert (
            metric("gpusnap_make_room_total", trigger="min_free_gpu_memory", result="short")
            == short + 1
        )
        warnings = [r for r in caplog.records if "below min_free_gpu_memory" in r.getMessage()]
        assert len(warnings) == 1 and "GPU 0" in warnings[0].getMessage()

        # still short on the next tick (alice still busy): tried again, not said again
        (result,) = await watcher.room.keep_gpu_free()
        assert result["parked"] == [] and not result["enough"]
        assert (
            len([r for r in caplog.records if "below min_free_gpu_memory" in r.getMessage()]) == 1
        )

        # the cell ends: alice is parked, the GPU has enough again, and the log says so
        driver.busy.clear()
        (result,) = await watcher.room.keep_gpu_free()
        assert result["parked"] == ["alice/"] and result["enough"]
        assert await watcher.room.keep_gpu_free() == []
        assert any("met again" in r.getMessage() for r in caplog.records)


async def test_make_room_on_one_gpu_counts_only_that_gpus_bytes(tmp_path, five):
    alice, bob, *_ = five
    devices = [
        {"name": "NVIDIA H100", "procs": {alice: 4 * U, bob: 8 * U}, "samples": [], "util": 0},
        {"name": "NVIDIA H100", "procs": {alice: 30 * U}, "samples": [], "util": 0},
    ]
    servers = [("alice", alice, State.idle, 900), ("bob", bob, State.idle, 600)]
    watcher, driver = shared_watcher(tmp_path, servers, devices)
    # alice holds 34 U, but only 4 on GPU 0: not enough for 10 U there, so bob goes too
    result = await watcher.room.make_room(10 * U, gpu=0)
    assert (
        result["parked"] == ["alice/", "bob/"]
        and result["freed_bytes"] == 12 * U
        and result["enough"]
    )
    assert driver.states[alice] == CHECKPOINTED and driver.states[bob] == CHECKPOINTED


async def test_min_free_gpu_memory_without_a_gpu_does_nothing(tmp_path, caplog):
    """This host as it is: no libcuda, no NVML. The setting is harmless and says so once."""
    store = Store(f"sqlite:///{tmp_path}/gpusnap.sqlite")
    watcher = Watcher(hub=None, store=store, policy=Policy([], Rule()), sources=[], backend=None, log=log,
                      min_free_gpu_memory=8 * U)  # fmt: skip
    with caplog.at_level(logging.INFO, logger=log.name):
        assert await watcher.room.keep_gpu_free() == []
        assert await watcher.room.keep_gpu_free() == []
    said = [r for r in caplog.records if "min_free_gpu_memory is set" in r.getMessage()]
    assert len(said) == 1
    assert not watcher.room.cuda.available()
    # off by default, and never negative
    assert (
        Watcher(
            hub=None, store=store, policy=Policy([]), sources=[], backend=None
        ).min_free_gpu_memory
        == 0
    )
    with pytest.raises(TraitError):
        Watcher(
            hub=None,
            store=store,
            policy=Policy([]),
            sources=[],
            backend=None,
            min_free_gpu_memory=-1,
        )
