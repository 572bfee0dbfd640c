"""Auto-unpark in the single-user server: a parked kernel that goes busy gets its GPU memory back.

Real kernels (jupyter_server's kernel manager, ipykernel); the CUDA driver is the ctypes-level
fake of tests/test_cuda_absent.py (no GPU here); tests/test_gpu.py covers the real driver.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from datetime import datetime

import pytest
from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager
from test_cuda_absent import CHECKPOINTED, LOCKED, RUNNING, FakeLibcuda

from jupyterhub_gpusnap.checkpoint import CheckpointError
from jupyterhub_gpusnap.gpu.autounpark import AutoUnpark, kernel_pid
from jupyterhub_gpusnap.gpu.cuda import CudaCheckpoint

log = logging.getLogger("test")


async def wait_state(km, kid, state, timeout=30):
    for _ in range(int(timeout / 0.05)):
        if km.get_kernel(kid).execution_state == state:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"kernel never became {state}")


async def start_cell(km, kid, code):
    """Run ``code`` in kernel ``kid`` and wait until the kernel manager sees it busy.

    The manager's own view is waited on first: a cell sent before its iopub subscription
    is up would go busy and idle unseen on a loaded machine. A kernel_info request makes
    the kernel publish busy/idle; once the manager has seen that idle it is listening."""
    client = km.get_kernel(kid).client()
    client.start_channels()
    for _ in range(600):
        client.kernel_info()
        await asyncio.sleep(0.05)
        if km.get_kernel(kid).execution_state == "idle":
            break
    else:
        raise AssertionError("the kernel manager never saw the kernel idle")
    client.execute(code)
    await wait_state(km, kid, "busy")
    return client


async def test_busy_parked_kernel_is_unparked_and_idle_ones_are_not(tmp_path):
    km = AsyncMappingKernelManager(root_dir=str(tmp_path))
    busy_id = await km.start_kernel()
    idle_id = await km.start_kernel()
    try:
        busy_pid = kernel_pid(km.get_kernel(busy_id))
        idle_pid = kernel_pid(km.get_kernel(idle_id))
        driver = FakeLibcuda([busy_pid, idle_pid])
        driver.states[busy_pid] = LOCKED  # parked: locked and checkpointed
        driver.states[busy_pid] = CHECKPOINTED
        driver.states[idle_pid] = CHECKPOINTED
        watcher = AutoUnpark(km, cuda=CudaCheckpoint(driver=driver, log=log), log=log)
        assert watcher.parked_kernels() == {busy_id: [busy_pid], idle_id: [idle_pid]}
        assert await watcher.check_once() == []  # nobody is running a cell

        client = await start_cell(km, busy_id, "import time; time.sleep(3)")
        assert await watcher.check_once() == [busy_id]
        assert driver.states[busy_pid] == RUNNING
        assert driver.states[idle_pid] == CHECKPOINTED  # the idle kernel stays parked
        assert watcher.unparks[-1]["kernel"] == busy_id
        assert await watcher.check_once() == []  # idempotent: nothing left to do
        client.stop_channels()
    finally:
        await km.shutdown_all()


async def test_without_a_driver_nothing_runs(tmp_path):
    km = AsyncMappingKernelManager(root_dir=str(tmp_path))
    watcher = AutoUnpark(km, log=log)  # the real CUDA layer: no libcuda on this machine
    assert not watcher.cuda.available()
    watcher.start()
    assert watcher._task is None
    assert watcher.parked_kernels() == {}


class SlowRestoreLibcuda(FakeLibcuda):
    """The fake driver, whose restore of GPU memory waits until ``go`` is set (a big restore)."""

    def __init__(self, pids):
        super().__init__(pids)
        self.go = threading.Event()
        self.restoring = threading.Event()

    def cuCheckpointProcessRestore(self, pid, ref):
        self.restoring.set()
        self.go.wait(30)
        return super().cuCheckpointProcessRestore(pid, ref)


async def test_the_state_says_resuming_while_an_unpark_runs(tmp_path):
    km = AsyncMappingKernelManager(root_dir=str(tmp_path))
    kid = await km.start_kernel()
    driver = None
    try:
        pid = kernel_pid(km.get_kernel(kid))
        driver = SlowRestoreLibcuda([pid])
        driver.states[pid] = CHECKPOINTED
        watcher = AutoUnpark(km, cuda=CudaCheckpoint(driver=driver, log=log), log=log)
        state = watcher.state()
        assert state["resuming"] is False and state["last_unpark"] is None
        assert state["watching"] is False  # not started: check_once is driven by the test

        client = await start_cell(km, kid, "import time; time.sleep(5)")
        before = time.time()
        check = asyncio.ensure_future(watcher.check_once())
        while not driver.restoring.is_set():
            await asyncio.sleep(0.01)
        state = watcher.state()
        assert state["resuming"] is True and state["resuming_kernels"] == [kid]
        since = datetime.fromisoformat(state["resuming_since"].replace("Z", "+00:00")).timestamp()
        assert before - 1 <= since <= time.time()
        assert state["resuming_since"].endswith("Z")

        driver.go.set()
        assert await check == [kid]
        state = watcher.state()
        assert state["resuming"] is False and state["resuming_kernels"] == []
        assert state["resuming_since"] is None
        assert state["last_unpark"]["kernel"] == kid and state["last_unpark"]["at"].endswith("Z")
        assert driver.states[pid] == RUNNING
        client.stop_channels()
    finally:
        if driver is not None:
            driver.go.set()
        await km.shutdown_all()


async def test_a_failed_unpark_does_not_stay_resuming(tmp_path):
    km = AsyncMappingKernelManager(root_dir=str(tmp_path))
    kid = await km.start_kernel()
    try:
        pid = kernel_pid(km.get_kernel(kid))
        driver = FakeLibcuda([pid])
        driver.states[pid] = CHECKPOINTED
        driver.fail_restore.add(pid)  # no room on the GPU: the driver refuses
        watcher = AutoUnpark(km, cuda=CudaCheckpoint(driver=driver, log=log), log=log)
        client = await start_cell(km, kid, "import time; time.sleep(5)")
        with pytest.raises(CheckpointError, match="host RAM"):
            await watcher.check_once()  # run() logs it and tries again on its next look
        assert watcher.state()["resuming"] is False
        assert driver.states[pid] == CHECKPOINTED  # still parked, data safe in host RAM
        client.stop_channels()
    finally:
        await km.shutdown_all()
