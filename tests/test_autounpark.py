"""Auto-unpark in the single-user server: a parked kernel that goes busy gets its GPU memory back.

Real kernels (jupyter_server's kernel manager, ipykernel); the CUDA driver is the ctypes-level
fake of tests/helpers/fake_gpu.py (no GPU here); tests/test_gpu.py covers the real driver.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime

import pytest
from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager

from jupyterhub_gpusnap.checkpoint import CheckpointError
from jupyterhub_gpusnap.gpu.autounpark import AutoUnpark, kernel_pid
from jupyterhub_gpusnap.gpu.cuda import CudaCheckpoint
from tests.helpers.fake_gpu import CHECKPOINTED, LOCKED, RUNNING, FakeLibcuda, SlowRestoreLibcuda
from tests.helpers.kernel_manager import start_cell

log = logging.getLogger("test")


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
