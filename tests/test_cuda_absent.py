"""The CUDA checkpoint layer, the NVML signal and park/unpark on a host without a GPU.

Two kinds of test: against this host as it is (no libcuda, no NVML: everything must be
a clean no-op), and against driver-level fakes of ``libcuda.so.1``'s checkpoint API and
of NVML (same function names, ctypes arguments and return codes) so that the
all-or-nothing, idempotence and memory-check logic runs on CPU-only CI with real
processes.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time

import psutil
import pytest

from jupyterhub_gpusnap.checkpoint.base import CheckpointError, CheckpointRefused
from jupyterhub_gpusnap.gpu.cuda import (
    CudaCheckpoint,
    GpuBusy,
)
from jupyterhub_gpusnap.gpu.nvml import Nvml
from jupyterhub_gpusnap.gpu.park import GiB, Parking, ParkResult, check_host_memory, park, unpark
from jupyterhub_gpusnap.model import Server
from jupyterhub_gpusnap.procs import tree_pids
from jupyterhub_gpusnap.signals.nvml import NvmlSignal
from tests.helpers.fake_gpu import CHECKPOINTED, RUNNING, FakeLibcuda, FakeNvmlLib


@pytest.fixture
def log():
    return logging.getLogger("gpusnap-test")


@pytest.fixture
def procs(sleepers):
    """Real processes standing in for a server's kernels."""
    return sleepers(2)


@pytest.fixture
def tree():
    """A real process tree: a shell (the 'server') with a child (the 'kernel')."""
    root = subprocess.Popen(["/bin/sh", "-c", "sleep 60; :"])
    for _ in range(200):
        kids = psutil.Process(root.pid).children()
        if kids:
            break
        time.sleep(0.01)
    yield root.pid, kids[0].pid
    for k in kids:
        k.kill()
    root.kill()
    root.wait()


# --- this host as it is: no driver, no NVML ------------------------------------------------


async def test_checkpoint_layer_is_a_clean_no_op_without_a_driver(procs, log, caplog):
    cuda = CudaCheckpoint(log=log)
    assert cuda.available() is False
    assert "libcuda.so.1" in cuda.reason
    assert cuda.driver_version() is None
    assert cuda.cuda_version() is None
    assert cuda.state(procs[0]) is None
    with caplog.at_level(logging.INFO, logger="gpusnap-test"):
        assert await cuda.suspend(procs) == []
        assert await cuda.resume(procs) == []
        assert await cuda.resume(None) == []
    assert sum("GPU checkpoint off" in r.getMessage() for r in caplog.records) == 1
    assert cuda.gpu_memory_of(procs) == 0
    inv = cuda.gpu_inventory(procs)
    assert inv["gpu_count"] == 0 and inv["gpu_model"] == "" and inv["gpu_bytes"] == 0
    for pid in procs:
        assert psutil.Process(pid).status() != psutil.STATUS_STOPPED


async def test_park_and_unpark_are_empty_without_a_driver(procs, log):
    cuda = CudaCheckpoint(log=log)
    assert await park(procs, cuda) == ParkResult()
    assert await unpark(procs, cuda) == ParkResult()
    parking = Parking(cuda=cuda)
    assert (await parking.park(procs)).pids == []
    assert (await parking.unpark(None)).bytes_moved == 0


async def test_gpu_signal_says_nothing_without_nvml(tree, log, caplog):
    root, _ = tree
    signal = NvmlSignal(log=log)
    with caplog.at_level(logging.INFO, logger="gpusnap-test"):
        await signal.setup()
        server = Server(user="alice", name="", state={"pid": root})
        first = await signal.sample(server)
        second = await signal.sample(server)
    await signal.close()
    for s in (first, second):
        assert s.errors == {}
        assert s.gpu_percent is None and s.gpu_memory_bytes is None and s.gpu_count is None
    said = [r.getMessage() for r in caplog.records if "no GPU signal" in r.getMessage()]
    assert len(said) == 1 and "NVML not available" in said[0]


# --- the host-RAM check ------------------------------------------------------------------


def test_host_memory_check():
    check_host_memory(8 * GiB, 20 * GiB, 2 * GiB)
    check_host_memory(0, 0, 2 * GiB)  # nothing to move never needs room
    with pytest.raises(CheckpointRefused) as info:
        check_host_memory(24 * GiB, 25 * GiB, 2 * GiB)
    msg = str(info.value)
    assert "not enough host RAM to park" in msg
    assert "24.0 GiB" in msg and "25.0 GiB" in msg and "host_memory_margin" in msg
    assert info.value.retry is True


async def test_park_refuses_when_host_ram_is_short(procs, log):
    driver = FakeLibcuda(procs)
    huge = psutil.virtual_memory().available + 1024 * GiB
    nvml = Nvml(
        FakeNvmlLib([{"name": "NVIDIA H100", "procs": {procs[0]: huge}, "samples": [], "util": 0}])
    )
    cuda = CudaCheckpoint(driver=driver, nvml=nvml, log=log)
    with pytest.raises(CheckpointRefused, match="not enough host RAM"):
        await park(procs, cuda)
    assert driver.calls == []  # refused before touching the driver
    assert set(driver.states.values()) == {RUNNING}
    # with room to spare the same park goes through
    nvml._module.devices[0]["procs"] = {procs[0]: GiB}
    result = await park(procs, cuda, host_margin_bytes=0)
    assert result.pids == [procs[0]] and result.bytes_moved == GiB
    # a process that only loaded the driver (no GPU memory) is not parked: it stays usable,
    # as the single-user server running auto-unpark must
    assert driver.states[procs[1]] == RUNNING


# --- the driver logic, against the driver-level fake ---------------------------------------


async def test_suspend_locks_all_then_checkpoints_and_resume_undoes_it(procs, log):
    # the driver tracks this process too (it called cuInit), as a real driver does
    driver = FakeLibcuda(procs + [os.getpid()])
    cuda = CudaCheckpoint(driver=driver, log=log, lock_timeout_ms=1234)
    assert cuda.available() and cuda.cuda_version() == "13.0"
    no_cuda = psutil.Process().ppid()  # a live process the driver does not know
    assert await cuda.suspend(procs + [os.getpid(), no_cuda]) == sorted(procs)
    # all locked first, then checkpointed (in parallel threads: in either order)
    assert driver.calls[:2] == [("lock", procs[0]), ("lock", procs[1])]
    assert sorted(driver.calls[2:]) == sorted([("checkpoint", p) for p in procs])
    assert driver.timeouts == [1234, 1234]
    assert [cuda.state(p) for p in procs] == ["checkpointed", "checkpointed"]
    assert cuda.state(os.getpid()) == "running"
    assert cuda.state(no_cuda) is None

    driver.calls.clear()
    assert await cuda.suspend(procs) == sorted(procs)  # idempotent
    assert driver.calls == []

    assert sorted(await cuda.resume(None)) == sorted(procs)
    assert [cuda.state(p) for p in procs] == ["running", "running"]
    assert await cuda.resume(procs) == []  # idempotent


async def test_busy_gpu_refuses_and_unlocks_what_it_locked(procs, log):
    driver = FakeLibcuda(procs)
    driver.busy.add(procs[1])
    cuda = CudaCheckpoint(driver=driver, log=log)
    with pytest.raises(GpuBusy) as info:
        await cuda.suspend(procs, lock_timeout_ms=1)
    assert str(info.value) == f"GPU busy: a cell is running on pid {procs[1]}; try later"
    assert info.value.retry is True and isinstance(info.value, CheckpointRefused)
    assert driver.calls == [("lock", procs[0]), ("lock", procs[1]), ("unlock", procs[0])]
    assert set(driver.states.values()) == {RUNNING}


async def test_failed_checkpoint_rolls_back_the_others(procs, log):
    driver = FakeLibcuda(procs)
    driver.fail_checkpoint.add(procs[1])
    cuda = CudaCheckpoint(driver=driver, log=log)
    with pytest.raises(CheckpointError) as info:
        await cuda.suspend(procs)
    assert not isinstance(info.value, CheckpointRefused)
    assert f"pid {procs[1]}" in str(info.value) and "CUDA_ERROR_UNKNOWN" in str(info.value)
    assert set(driver.states.values()) == {RUNNING}
    assert ("restore", procs[0]) in driver.calls


async def test_failed_restore_keeps_the_process_checkpointed_and_says_why(procs, log):
    driver = FakeLibcuda(procs)
    cuda = CudaCheckpoint(driver=driver, log=log)
    await cuda.suspend(procs)
    driver.fail_restore.add(procs[0])
    with pytest.raises(CheckpointError, match="free GPU memory") as info:
        await cuda.resume(procs)
    assert "CUDA_ERROR_OUT_OF_MEMORY" in str(info.value)
    assert driver.states == {procs[0]: CHECKPOINTED, procs[1]: RUNNING}
    driver.fail_restore.clear()
    assert await cuda.resume(None) == [procs[0]]


async def test_failed_state_is_refused(procs, log):
    driver = FakeLibcuda(procs)
    driver.states[procs[0]] = 3
    cuda = CudaCheckpoint(driver=driver, log=log)
    with pytest.raises(CheckpointRefused, match="restart that kernel"):
        await cuda.suspend(procs)
    assert driver.calls == []


async def test_process_exiting_meanwhile_is_skipped(log):
    gone = subprocess.Popen(["sleep", "60"])
    stays = subprocess.Popen(["sleep", "60"])
    try:
        driver = FakeLibcuda([gone.pid, stays.pid])
        cuda = CudaCheckpoint(driver=driver, log=log)
        assert await cuda.suspend([gone.pid, stays.pid]) == sorted([gone.pid, stays.pid])
        gone.kill()
        gone.wait()
        assert await cuda.resume(None) == [stays.pid]
        # exited between the state query and the lock
        driver.states[gone.pid] = RUNNING
        real_state = driver.cuCheckpointProcessGetState

        def state_as_if_alive(pid, ref):
            if pid == gone.pid:
                ref._obj.value = RUNNING
                return 0
            return real_state(pid, ref)

        driver.cuCheckpointProcessGetState = state_as_if_alive
        assert await cuda.suspend([gone.pid, stays.pid]) == [stays.pid]
        assert await cuda.resume([stays.pid]) == [stays.pid]
    finally:
        stays.kill()
        stays.wait()


# --- the NVML signal's logic, against an NVML-level fake -----------------------------------


async def test_gpu_signal_maps_the_process_tree(tree, log):
    root, kernel = tree
    other = 999_999
    devices = [
        {
            "name": "NVIDIA H100",
            "procs": {kernel: 3 * GiB, other: GiB},
            "util": 100,
            "samples": [(10, kernel, 1), (11, other, 95), (12, kernel, 2)],
        },
        {"name": "NVIDIA H100", "procs": {other: GiB}, "util": 100, "samples": [(10, other, 90)]},
    ]
    lib = FakeNvmlLib(devices)
    signal = NvmlSignal(nvml=Nvml(lib), log=log)
    await signal.setup()
    server = Server(user="alice", name="", state={"pid": root})
    assert tree_pids(root) == [root, kernel]

    s = await signal.sample(server)
    assert s.errors == {}
    assert (s.gpu_percent, s.gpu_memory_bytes, s.gpu_count) == (2, 3 * GiB, 1)

    devices[0]["samples"].append((20, kernel, 94))
    s = await signal.sample(server)
    assert s.gpu_percent == 94

    devices[0]["samples"].append((30, kernel, 0))
    s = await signal.sample(server)
    assert s.gpu_percent == 0  # only samples since the previous reading count

    # a second server on the same GPU still sees every sample
    other_server = Server(user="bob", name="", state={"pid": root})
    assert (await signal.sample(other_server)).gpu_percent == 94


async def test_gpu_signal_falls_back_to_device_utilisation(tree, log):
    root, kernel = tree
    devices = [
        {
            "name": "NVIDIA A100",
            "procs": {kernel: GiB},
            "util": 37,
            "samples": [],
            "per_process": False,
        }
    ]
    server = Server(user="alice", name="", state={"pid": root})

    signal = NvmlSignal(nvml=Nvml(FakeNvmlLib(devices)), log=log)
    await signal.setup()
    s = await signal.sample(server)
    assert (s.gpu_percent, s.gpu_memory_bytes, s.gpu_count) == (37, GiB, 1)

    strict = NvmlSignal(nvml=Nvml(FakeNvmlLib(devices)), device_fallback=False, log=log)
    await strict.setup()
    s = await strict.sample(server)
    assert s.gpu_percent is None and s.gpu_memory_bytes == GiB


async def test_gpu_signal_without_gpu_use_reads_zero(tree, log):
    root, _ = tree
    devices = [{"name": "NVIDIA H100", "procs": {}, "util": 100, "samples": [(5, 1234567, 99)]}]
    signal = NvmlSignal(nvml=Nvml(FakeNvmlLib(devices)), log=log)
    await signal.setup()
    s = await signal.sample(Server(user="alice", state={"pid": root}))
    assert (s.gpu_percent, s.gpu_memory_bytes, s.gpu_count) == (0, 0, 0)
    gone = await signal.sample(Server(user="alice", state={}))
    assert "admin:server_state" in gone.errors["gpu"]


async def test_gpu_inventory_from_nvml(procs, log):
    devices = [
        {"name": "NVIDIA H100 80GB HBM3", "procs": {procs[0]: 2 * GiB}, "util": 0, "samples": []},
        {"name": "NVIDIA H100 80GB HBM3", "procs": {procs[1]: GiB}, "util": 0, "samples": []},
    ]
    cuda = CudaCheckpoint(driver=FakeLibcuda(procs), nvml=Nvml(FakeNvmlLib(devices)), log=log)
    inv = cuda.gpu_inventory(procs)
    assert inv["gpu_model"] == "NVIDIA H100 80GB HBM3" and inv["gpu_count"] == 2
    assert inv["driver_version"] == "580.159.04" and inv["cuda_version"] == "13.0"
    assert inv["gpu_bytes"] == 3 * GiB and inv["gpu_devices"] == [0, 1]
    assert cuda.gpu_memory_of([procs[1]]) == GiB
    assert cuda.driver_version() == "580.159.04"
