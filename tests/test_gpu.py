"""The CUDA checkpoint layer, the NVML signal and park/unpark against a real GPU.

Selected with ``-m gpu`` on a machine with an NVIDIA GPU, driver >= 570 and PyTorch
(for the helper process). Without a GPU these tests fail: they are not meant to run
on CPU-only machines (tests/test_cuda_absent.py covers those).
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from jupyterhub_gpusnap.checkpoint.base import CheckpointRefused
from jupyterhub_gpusnap.gpu.cuda import CudaCheckpoint, GpuBusy
from jupyterhub_gpusnap.gpu.nvml import Nvml
from jupyterhub_gpusnap.gpu.park import Parking, park, unpark
from jupyterhub_gpusnap.model import Server
from jupyterhub_gpusnap.procs import tree_pids
from jupyterhub_gpusnap.signals.nvml import NvmlSignal
from tests.helpers.gpu_helpers import GiB, GpuProcess

pytestmark = pytest.mark.gpu

HOLD_GIB = 2


@pytest.fixture(scope="module")
def holder():
    """One PyTorch process holding 2 GiB of random data, under a shell parent."""
    h = GpuProcess(["hold", "--gib", str(HOLD_GIB)], via_shell=True)
    yield h
    h.stop()


@pytest.fixture
def cuda():
    c = CudaCheckpoint()
    assert c.available(), c.reason
    return c


@pytest.fixture
async def signal():
    s = NvmlSignal()
    await s.setup()
    yield s
    await s.close()


def server_of(h: GpuProcess) -> Server:
    return Server(user="alice", name="gpu", state={"pid": h.root_pid})


def device_free_bytes() -> int:
    nv = Nvml()
    assert nv.open(), nv.reason
    return int(nv._module.nvmlDeviceGetMemoryInfo(nv._module.nvmlDeviceGetHandleByIndex(0)).free)


def test_driver_facts(cuda, holder):
    assert cuda.driver_version()[0].isdigit()
    major = int(cuda.cuda_version().split(".")[0])
    assert major >= 12
    inv = cuda.gpu_inventory([holder.pid])
    assert inv["gpu_count"] >= 1
    assert "NVIDIA" in inv["gpu_model"]
    assert inv["gpu_bytes"] >= HOLD_GIB * GiB
    assert inv["gpu_devices"] == [0]
    assert cuda.state(holder.root_pid) is None  # the shell parent never loaded CUDA
    assert cuda.state(holder.pid) == "running"
    # this process only called cuInit (no context, not in NVML), yet the driver tracks it:
    # suspend must leave its caller alone
    assert cuda.state(os.getpid()) == "running"
    assert cuda.gpu_memory_of([os.getpid()]) == 0


async def test_suspend_never_touches_its_own_process(cuda):
    assert await cuda.suspend([os.getpid()], lock_timeout_ms=1) == []
    assert cuda.state(os.getpid()) == "running"


async def test_idle_process_reads_idle_with_memory(signal, holder):
    server = server_of(holder)
    assert holder.pid in tree_pids(holder.root_pid)
    await signal.read(server, time.time())  # baseline: later readings cover only what follows
    await asyncio.sleep(3)
    sample = await signal.read(server, time.time())
    assert sample.errors == {}
    assert sample.gpu_percent is not None and sample.gpu_percent < 5, sample
    assert sample.gpu_memory_bytes >= HOLD_GIB * GiB
    assert sample.gpu_count == 1


async def test_matmul_loop_reads_active(signal, holder):
    server = server_of(holder)
    await signal.read(server, time.time())
    holder.busy()
    try:
        seen = []
        for _ in range(30):
            await asyncio.sleep(1)
            sample = await signal.read(server, time.time())
            seen.append(sample.gpu_percent)
            if sample.gpu_percent is not None and sample.gpu_percent > 50:
                break
    finally:
        holder.idle()
    assert max(p for p in seen if p is not None) > 50, seen


async def test_lock_on_busy_process_is_gpu_busy(cuda, holder):
    holder.busy()
    try:
        with pytest.raises(GpuBusy) as info:
            await cuda.suspend(tree_pids(holder.root_pid), lock_timeout_ms=1)
        assert info.value.retry is True
        assert f"pid {holder.pid}" in str(info.value)
        assert isinstance(info.value, CheckpointRefused)
        assert cuda.state(holder.pid) == "running"  # nothing was left locked
    finally:
        holder.idle()


async def test_suspend_frees_gpu_and_resume_is_bit_identical(cuda, holder):
    before = holder.checksum()
    free_before = device_free_bytes()
    pids = tree_pids(holder.root_pid)

    assert await cuda.suspend(pids) == [holder.pid]
    assert cuda.state(holder.pid) == "checkpointed"
    assert await cuda.suspend(pids) == [holder.pid]  # idempotent
    assert cuda.gpu_memory_of([holder.pid]) == 0  # gone from NVML's process list

    # another process can now take more memory than was free before the suspend
    claimant = GpuProcess(["fill"])
    try:
        assert claimant.nbytes > free_before
    finally:
        claimant.stop()
    for _ in range(100):  # the driver frees an exited process's memory shortly after exit
        if device_free_bytes() >= free_before:
            break
        await asyncio.sleep(0.1)

    assert await cuda.resume(pids) == [holder.pid]
    assert cuda.state(holder.pid) == "running"
    assert await cuda.resume(pids) == []  # idempotent
    assert holder.touch().startswith("TOUCHED")
    assert holder.checksum() == before
    assert cuda.gpu_memory_of([holder.pid]) >= HOLD_GIB * GiB


async def test_park_unpark_round_trip(cuda, holder):
    before = holder.checksum()
    pids = tree_pids(holder.root_pid)

    parked = await park(pids, cuda, lock_timeout_ms=5000)
    assert parked.pids == [holder.pid]
    assert parked.bytes_moved >= HOLD_GIB * GiB
    again = await park(pids, cuda, lock_timeout_ms=5000)
    assert again.pids == [holder.pid] and again.bytes_moved == 0

    back = await unpark(pids, cuda)
    assert back.pids == [holder.pid]
    assert back.bytes_moved >= HOLD_GIB * GiB
    assert (await unpark(pids, cuda)).pids == []
    assert holder.checksum() == before

    # the configurable form, unparking everything it parked
    parking = Parking(cuda=cuda)
    assert (await parking.park(pids)).pids == [holder.pid]
    assert (await parking.unpark(None)).pids == [holder.pid]
    assert holder.checksum() == before


async def test_process_exiting_while_parked_is_skipped(cuda):
    h = GpuProcess(["hold", "--gib", "0.25"])
    try:
        assert await cuda.suspend([h.pid]) == [h.pid]
    finally:
        h.kill()
    assert await cuda.resume([h.pid]) == []
    assert await cuda.resume(None) == []
