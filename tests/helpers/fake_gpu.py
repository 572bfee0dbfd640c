"""Driver-level fakes of the GPU: ``libcuda.so.1``'s checkpoint API and NVML.

Same function names, ctypes arguments and return codes as the real libraries, so that
the CUDA checkpoint layer, park/unpark, make-room and the NVML signal run on a host
without a GPU, with real processes standing in for the kernels.
"""

from __future__ import annotations

import ctypes
import threading
from types import SimpleNamespace

import psutil
import pynvml

from jupyterhub_gpusnap.gpu.cuda import (
    CUcheckpointCheckpointArgs,
    CUcheckpointLockArgs,
    CUcheckpointRestoreArgs,
    CUcheckpointUnlockArgs,
)
from jupyterhub_gpusnap.gpu.park import GiB

RUNNING, LOCKED, CHECKPOINTED = 0, 1, 2


class FakeLibcuda:
    """The checkpoint API of libcuda.so.1 as ctypes sees it: ``f(pid, byref(args)) -> CUresult``.

    ``states`` holds the CUprocessState of each pid with a CUDA context. Arguments are
    checked as the driver documents them: 64-byte structs whose reserved fields are zero.
    """

    def __init__(self, pids):
        self.states = {pid: RUNNING for pid in pids}
        self.calls: list[tuple[str, int]] = []
        self.timeouts: list[int] = []
        self.busy: set[int] = set()
        self.fail_checkpoint: set[int] = set()
        self.fail_restore: set[int] = set()

    @staticmethod
    def _alive(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    @staticmethod
    def _args(ref, cls, skip=0):
        obj = ref._obj
        assert type(obj) is cls
        assert ctypes.sizeof(obj) == 64
        assert bytes(obj)[skip:] == bytes(64 - skip), "reserved fields must be zero"
        return obj

    def cuInit(self, flags):
        assert flags == 0
        return 0

    def cuDriverGetVersion(self, ref):
        ref._obj.value = 13000
        return 0

    def cuCheckpointProcessGetState(self, pid, ref):
        if pid not in self.states or not self._alive(pid):
            return 1  # CUDA_ERROR_INVALID_VALUE
        ref._obj.value = self.states[pid]
        return 0

    def _step(self, name, pid, want, new, fail_code=None):
        self.calls.append((name, pid))
        if pid not in self.states or not self._alive(pid):
            return 1
        if self.states[pid] != want:
            return 401  # CUDA_ERROR_ILLEGAL_STATE
        if fail_code is not None:
            return fail_code
        self.states[pid] = new
        return 0

    def cuCheckpointProcessLock(self, pid, ref):
        args = self._args(ref, CUcheckpointLockArgs, skip=4)
        self.timeouts.append(args.timeoutMs)
        return self._step("lock", pid, RUNNING, LOCKED, 600 if pid in self.busy else None)

    def cuCheckpointProcessCheckpoint(self, pid, ref):
        self._args(ref, CUcheckpointCheckpointArgs)
        fail = 999 if pid in self.fail_checkpoint else None
        return self._step("checkpoint", pid, LOCKED, CHECKPOINTED, fail)

    def cuCheckpointProcessRestore(self, pid, ref):
        self._args(ref, CUcheckpointRestoreArgs)
        fail = 2 if pid in self.fail_restore else None  # CUDA_ERROR_OUT_OF_MEMORY
        return self._step("restore", pid, CHECKPOINTED, LOCKED, fail)

    def cuCheckpointProcessUnlock(self, pid, ref):
        self._args(ref, CUcheckpointUnlockArgs)
        return self._step("unlock", pid, LOCKED, RUNNING)


class FakeNvmlLib:
    """The pynvml functions the project calls, answering for made-up devices.

    ``devices``: dicts with ``name``, ``procs`` ({pid: bytes}), ``samples``
    ([(timestamp, pid, smUtil)]), ``util`` (device percent), ``per_process`` (supported),
    and optionally ``total`` and ``free`` (bytes; default 80 and 70 GiB) and ``uuid``
    (without it nvmlDeviceGetUUID answers NOT_SUPPORTED).
    """

    def __init__(self, devices):
        self.devices = devices

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlSystemGetDriverVersion(self):
        return "580.159.04"

    def nvmlDeviceGetName(self, h):
        return self.devices[h]["name"]

    def nvmlDeviceGetMemoryInfo(self, h):
        dev = self.devices[h]
        total, free = dev.get("total", 80 * GiB), dev.get("free", 70 * GiB)
        return SimpleNamespace(total=total, free=free, used=total - free)

    def nvmlDeviceGetUUID(self, h):
        if "uuid" not in self.devices[h]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.devices[h]["uuid"]

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [
            SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in self.devices[h]["procs"].items()
        ]

    def nvmlDeviceGetProcessUtilization(self, h, since):
        dev = self.devices[h]
        if not dev.get("per_process", True):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        new = [
            SimpleNamespace(pid=p, timeStamp=ts, smUtil=sm, memUtil=0, encUtil=0, decUtil=0)
            for ts, p, sm in dev["samples"]
            if ts > since
        ]
        if not new:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return new

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=self.devices[h]["util"], memory=0)


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


U = 32 * 1024**2  # the unit of the made-up GPUs below: parks move real host RAM's worth of it


class SharedGpus(FakeNvmlLib):
    """NVML over made-up GPUs of 80 U whose memory follows the fake driver.

    As on a real GPU (FACTS: after a checkpoint the process is gone from
    nvmlDeviceGetComputeRunningProcesses and its memory is free), a checkpointed pid
    holds nothing. ``other`` is memory held by processes that are no server's.
    """

    def __init__(self, driver, devices):
        super().__init__(devices)
        self.driver = driver

    def _live(self, h):
        return {
            p: b
            for p, b in self.devices[h]["procs"].items()
            if self.driver.states.get(p) != CHECKPOINTED
        }

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in self._live(h).items()]

    def nvmlDeviceGetMemoryInfo(self, h):
        used = sum(self._live(h).values()) + self.devices[h].get("other", 0)
        return SimpleNamespace(total=80 * U, free=80 * U - used, used=used)
