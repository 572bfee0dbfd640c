"""The CUDA driver's checkpoint API: move a process's GPU memory to host RAM and back.

``cuCheckpointProcessLock/Checkpoint/Restore/Unlock/GetState`` (driver >= 570) are
called through ctypes on ``libcuda.so.1``; no ``cuda-checkpoint`` binary is needed.
After :meth:`CudaCheckpoint.suspend` the processes keep running on the CPU, their GPU
memory lives in their own host memory and the GPU is free; CRIU can then dump them, or
:meth:`CudaCheckpoint.resume` brings the GPU memory back.

On a machine without the driver (or with one older than 570) every operation is a
clean no-op: :meth:`CudaCheckpoint.available` is False and nothing raises.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
from typing import Any

import psutil
from traitlets import Any as AnyTrait
from traitlets import Integer, Unicode
from traitlets.config import LoggingConfigurable

from ..errors import CheckpointError, CheckpointRefused
from .nvml import Nvml

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600

#: CUprocessState values, as the names this project uses
PROCESS_STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}

_ERROR_NAMES = {
    0: "CUDA_SUCCESS",
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    4: "CUDA_ERROR_DEINITIALIZED",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    201: "CUDA_ERROR_INVALID_CONTEXT",
    304: "CUDA_ERROR_OPERATING_SYSTEM",
    401: "CUDA_ERROR_ILLEGAL_STATE",
    500: "CUDA_ERROR_NOT_FOUND",
    600: "CUDA_ERROR_NOT_READY",
    801: "CUDA_ERROR_NOT_SUPPORTED",
    999: "CUDA_ERROR_UNKNOWN",
}

_SYMBOLS = (
    "cuInit",
    "cuDriverGetVersion",
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
)


class CUcheckpointLockArgs(ctypes.Structure):
    """``CUcheckpointLockArgs`` (64 bytes): a lock timeout, the rest reserved and zero."""

    _fields_ = [
        ("timeoutMs", ctypes.c_uint),
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_uint64 * 7),
    ]


class CUcheckpointCheckpointArgs(ctypes.Structure):
    """``CUcheckpointCheckpointArgs`` (64 bytes, reserved, zero)."""

    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class CUcheckpointRestoreArgs(ctypes.Structure):
    """``CUcheckpointRestoreArgs`` (64 bytes): GPU remapping pairs (unused: NULL, 0), reserved."""

    _fields_ = [
        ("gpuPairs", ctypes.c_void_p),
        ("gpuPairsCount", ctypes.c_uint),
        ("reserved", ctypes.c_char * (52 - ctypes.sizeof(ctypes.c_void_p))),
        ("reserved1", ctypes.c_uint64),
    ]


class CUcheckpointUnlockArgs(ctypes.Structure):
    """``CUcheckpointUnlockArgs`` (64 bytes, reserved, zero)."""

    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class GpuBusy(CheckpointRefused):
    """The GPU is running work for this server (a cell is executing): try on a later tick."""

    def __init__(self, pid: int):
        super().__init__(f"GPU busy: a cell is running on pid {pid}; try later", retry=True)
        self.pid = pid


class CudaDriverError(CheckpointError):
    """A checkpoint API call returned an error code."""

    def __init__(self, call: str, pid: int, code: int, name: str, hint: str = ""):
        msg = f"{call} on pid {pid} failed: {name} ({code})"
        super().__init__(f"{msg}; {hint}" if hint else msg)
        self.call = call
        self.pid = pid
        self.code = code


def _load_libcuda(path: str) -> Any:
    lib = ctypes.CDLL(path)
    for name in _SYMBOLS:
        getattr(lib, name)  # AttributeError when the driver is older than 570
    lib.cuInit.argtypes = [ctypes.c_uint]
    lib.cuDriverGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.cuCheckpointProcessGetState.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    lib.cuCheckpointProcessLock.argtypes = [ctypes.c_int, ctypes.POINTER(CUcheckpointLockArgs)]
    lib.cuCheckpointProcessCheckpoint.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(CUcheckpointCheckpointArgs),
    ]
    lib.cuCheckpointProcessRestore.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(CUcheckpointRestoreArgs),
    ]
    lib.cuCheckpointProcessUnlock.argtypes = [ctypes.c_int, ctypes.POINTER(CUcheckpointUnlockArgs)]
    for name in _SYMBOLS:
        getattr(lib, name).restype = ctypes.c_int
    if hasattr(lib, "cuGetErrorName"):
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuGetErrorName.restype = ctypes.c_int
    return lib


#: libcuda_path -> (the initialised driver or None, why not), for this process
_DRIVERS: dict[str, tuple[Any, str]] = {}
_DRIVERS_LOCK = threading.Lock()


def _open_driver(driver: Any, path: str) -> tuple[Any, str]:
    """(``driver`` or ``path`` loaded, checked for the checkpoint API and initialised, "") or
    (None, why not)."""
    try:
        lib = driver if driver is not None else _load_libcuda(path)
    except OSError as e:
        return None, f"{path} not loadable ({e}); no NVIDIA driver on this host"
    except AttributeError as e:
        return None, (
            f"{path} lacks the checkpoint API ({e}); upgrade the NVIDIA driver to 570 or newer"
        )
    rc = lib.cuInit(0)
    if rc != CUDA_SUCCESS:
        return None, f"cuInit failed: {CudaCheckpoint._error_name(lib, rc)} ({rc})"
    return lib, ""


class CudaCheckpoint(LoggingConfigurable):
    """Suspend and resume the GPU memory of processes through the CUDA driver.

    All calls into the driver block (a checkpoint of 8 GiB takes seconds), so the
    async methods run them in threads. :meth:`suspend` is all-or-nothing over the
    pids it is given; both :meth:`suspend` and :meth:`resume` are idempotent.
    """

    libcuda_path = Unicode(
        "libcuda.so.1",
        help="""The CUDA driver library to load (a name the dynamic loader finds, or a full
        path such as /usr/lib/x86_64-linux-gnu/libcuda.so.1). Needs NVIDIA driver >= 570 for
        the checkpoint API; with an older driver GPU checkpointing is disabled and logged.""",
    ).tag(config=True)

    lock_timeout_ms = Integer(
        5000,
        help="""Milliseconds the driver waits for running GPU work to finish before it refuses
        to lock a process (the server then counts as busy and is retried on a later tick).
        0 waits without limit: avoid it, a long cell would block the service.""",
    ).tag(config=True)

    driver = AnyTrait(
        None,
        help="""An object with the driver's function names (cuInit, cuCheckpointProcessLock, …)
        to use instead of loading libcuda_path: for embedding in a process that already
        loaded the driver.""",
    )

    nvml = AnyTrait(None, help="An Nvml instance for GPU inventory; made when first needed.")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._load_lock = threading.Lock()
        self._loaded = False
        self._lib: Any = None
        self.reason = ""
        self._told_absent = False
        self._suspended: set[int] = set()

    # --- loading ---------------------------------------------------------------------

    def _load(self) -> Any:
        with self._load_lock:
            if self._loaded:
                return self._lib
            self._loaded = True
            if self.driver is not None:
                self._lib, self.reason = _open_driver(self.driver, self.libcuda_path)
            else:  # loaded and initialised once per process (the Hub has a layer per spawner)
                with _DRIVERS_LOCK:
                    opened = _DRIVERS.get(self.libcuda_path)
                    if opened is None:
                        opened = _DRIVERS[self.libcuda_path] = _open_driver(None, self.libcuda_path)
                self._lib, self.reason = opened
            return self._lib

    def _tell_absent(self) -> None:
        if not self._told_absent:
            self._told_absent = True
            self.log.info("GPU checkpoint off: %s", self.reason)

    def available(self) -> bool:
        """True when the driver and its checkpoint API can be used on this host."""
        return self._load() is not None

    @staticmethod
    def _error_name(lib: Any, code: int) -> str:
        if hasattr(lib, "cuGetErrorName"):
            out = ctypes.c_char_p()
            try:
                if lib.cuGetErrorName(code, ctypes.byref(out)) == CUDA_SUCCESS and out.value:
                    return out.value.decode()
            except Exception:
                pass
        return _ERROR_NAMES.get(code, "CUDA error")

    def cuda_version(self) -> str | None:
        """The CUDA version the driver supports, e.g. ``"13.0"``; None without a driver."""
        lib = self._load()
        if lib is None:
            return None
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) != CUDA_SUCCESS:
            return None
        return f"{v.value // 1000}.{(v.value % 1000) // 10}"

    def driver_version(self) -> str | None:
        """The NVIDIA display driver version (e.g. ``"580.159.04"``), None without a driver.

        Restoring a checkpoint needs the same driver branch: manifests record this.
        """
        if self._load() is None:
            return None
        v = self._nvml().driver_version()
        if v:
            return v
        try:
            with open("/proc/driver/nvidia/version") as f:
                for word in f.read().split():
                    if word[:1].isdigit() and word.count(".") >= 1:
                        return word
        except OSError:
            pass
        return None

    # --- single calls (blocking) -------------------------------------------------------

    def state(self, pid: int) -> str | None:
        """The CUDA state of ``pid``: running, locked, checkpointed or failed.

        None when the process never initialised CUDA (or is gone, or there is no driver).
        A process that only called ``cuInit`` (no context, nothing in NVML) already
        reads "running": the driver tracks every process that loaded it.
        """
        lib = self._load()
        if lib is None:
            return None
        st = ctypes.c_int(-1)
        rc = lib.cuCheckpointProcessGetState(int(pid), ctypes.byref(st))
        if rc != CUDA_SUCCESS:
            return None
        return PROCESS_STATES.get(st.value, "failed")

    def _call(self, call: str, pid: int, args: ctypes.Structure, hint: str = "") -> None:
        rc = getattr(self._lib, call)(int(pid), ctypes.byref(args))
        if rc == CUDA_SUCCESS:
            return
        if call == "cuCheckpointProcessLock" and rc == CUDA_ERROR_NOT_READY:
            raise GpuBusy(pid)
        raise CudaDriverError(call, pid, rc, self._error_name(self._lib, rc), hint)

    def lock(self, pid: int, timeout_ms: int) -> None:
        """Lock ``pid``: wait up to ``timeout_ms`` for its GPU work, then block new work."""
        args = CUcheckpointLockArgs()
        args.timeoutMs = int(timeout_ms)
        self._call("cuCheckpointProcessLock", pid, args)

    def checkpoint(self, pid: int) -> None:
        """Copy a locked process's GPU memory to its host memory and release the GPU."""
        self._call(
            "cuCheckpointProcessCheckpoint",
            pid,
            CUcheckpointCheckpointArgs(),
            "the process stays locked; resume() unlocks it",
        )

    def restore(self, pid: int) -> None:
        """Copy a checkpointed process's memory back to the GPU (it stays locked)."""
        self._call(
            "cuCheckpointProcessRestore",
            pid,
            CUcheckpointRestoreArgs(),
            "the process is still checkpointed and its GPU data is safe in host RAM; "
            "free GPU memory (another process may have taken it) and resume again",
        )

    def unlock(self, pid: int) -> None:
        """Let a locked (restored) process submit GPU work again."""
        self._call("cuCheckpointProcessUnlock", pid, CUcheckpointUnlockArgs())

    # --- whole operations ------------------------------------------------------------

    async def suspend(self, pids: list[int], lock_timeout_ms: int | None = None) -> list[int]:
        """Checkpoint the GPU memory of every pid that holds a CUDA context.

        Locks all of them first (a pid running GPU work for longer than
        ``lock_timeout_ms`` raises :class:`GpuBusy`), then checkpoints them in
        parallel. Returns the pids now checkpointed, those found already checkpointed
        included; this process itself is never touched. All or nothing: on any failure the pids already handled are restored
        and unlocked before the error is raised. Without a driver: returns [].
        """
        if self._load() is None:
            self._tell_absent()
            return []
        timeout = self.lock_timeout_ms if lock_timeout_ms is None else lock_timeout_ms
        own = os.getpid()  # this process initialised CUDA too; locking it would lock ourselves
        states = await asyncio.to_thread(lambda: {p: self.state(p) for p in pids if p != own})
        failed = [p for p, s in states.items() if s == "failed"]
        if failed:
            raise CheckpointRefused(
                f"CUDA reports pid {failed[0]} in state 'failed': its GPU state cannot be "
                "checkpointed; restart that kernel"
            )
        done = [p for p, s in states.items() if s == "checkpointed"]
        todo = [p for p, s in states.items() if s in ("running", "locked")]
        locked: list[int] = []
        checkpointed: list[int] = []
        try:
            for pid in todo:
                if states[pid] == "running":
                    if not await self._guard(self.lock, pid, timeout):
                        continue
                locked.append(pid)
            results = await asyncio.gather(
                *(self._guard(self.checkpoint, pid) for pid in locked), return_exceptions=True
            )
            errors = []
            for pid, r in zip(locked, results, strict=True):
                if isinstance(r, BaseException):
                    errors.append(r)
                elif r:
                    checkpointed.append(pid)
            if errors:
                raise errors[0]
        except BaseException as e:
            await self._roll_back(checkpointed, locked, e)
            raise
        result = sorted(set(done + checkpointed))
        self._suspended.update(result)
        if result:
            self.log.info("GPU memory of pids %s checkpointed to host memory", result)
        return result

    async def _guard(self, fn, pid: int, *args) -> bool:
        """Run one blocking call; False (no error) when ``pid`` exited meanwhile."""
        try:
            await asyncio.to_thread(fn, pid, *args)
            return True
        except CheckpointError:
            if not psutil.pid_exists(pid) or _is_zombie(pid):
                self.log.info("pid %d exited during a GPU checkpoint call; skipped", pid)
                return False
            raise

    async def _roll_back(
        self, checkpointed: list[int], locked: list[int], why: BaseException
    ) -> None:
        """Bring every pid touched by a failed suspend back to running; log what could not be."""
        problems = []
        for pid in checkpointed:
            try:
                await asyncio.to_thread(self.restore, pid)
            except CheckpointError as e:
                problems.append(str(e))
        for pid in locked:
            try:
                await asyncio.to_thread(self.unlock, pid)
            except CheckpointError as e:
                if self.state(pid) == "locked":
                    problems.append(str(e))
        level = self.log.warning if problems else self.log.info
        level(
            "GPU suspend of pids %s failed (%s); rolled back%s",
            locked,
            why,
            f" with problems: {'; '.join(problems)}" if problems else "",
        )

    async def resume(self, pids: list[int] | None = None) -> list[int]:
        """Restore and unlock every pid found checkpointed or locked; returns those resumed.

        ``None`` means every pid this object suspended. Pids that are running, have no
        CUDA context or have exited are skipped. Restores run in parallel; if some fail
        the others are still resumed and a :class:`CheckpointError` names the failures
        (those processes stay checkpointed, their data safe in host RAM).
        """
        if self._load() is None:
            self._tell_absent()
            return []
        wanted = sorted(self._suspended) if pids is None else list(pids)
        states = await asyncio.to_thread(lambda: {p: self.state(p) for p in wanted})
        to_restore = [p for p, s in states.items() if s == "checkpointed"]
        to_unlock = [p for p, s in states.items() if s in ("checkpointed", "locked")]
        results = await asyncio.gather(
            *(self._guard(self.restore, p) for p in to_restore), return_exceptions=True
        )
        errors = {
            p: r for p, r in zip(to_restore, results, strict=True) if isinstance(r, BaseException)
        }
        resumed = []
        for pid in to_unlock:
            if pid in errors:
                continue
            try:
                if await self._guard(self.unlock, pid):
                    resumed.append(pid)
            except CheckpointError as e:
                errors[pid] = e
        self._suspended.difference_update(resumed)
        self._suspended.difference_update(p for p, s in states.items() if s is None)
        if resumed:
            self.log.info("GPU memory of pids %s restored", resumed)
        if errors:
            raise CheckpointError("; ".join(str(e) for e in errors.values()))
        return resumed

    # --- GPU facts for manifests ---------------------------------------------------------

    def _nvml(self) -> Nvml:
        if self.nvml is None:
            self.nvml = Nvml.shared()
        self.nvml.open()
        return self.nvml

    def gpu_memory_by_pid(self, pids: list[int]) -> dict[int, int]:
        """GPU memory (bytes) of each of ``pids`` with a GPU context, over all GPUs; {} without NVML.

        A pid with a context whose usage NVML cannot tell is present with 0 bytes.
        """
        out: dict[int, int] = {}
        for per_pid in self._nvml().process_memory(list(pids)).values():
            for pid, used in per_pid.items():
                out[pid] = out.get(pid, 0) + used
        return out

    def gpu_memory_of(self, pids: list[int]) -> int:
        """GPU memory (bytes) held by ``pids`` now, from NVML; 0 without NVML."""
        nv = self._nvml()
        return sum(sum(d.values()) for d in nv.process_memory(list(pids)).values())

    def gpu_inventory(self, pids: list[int] | None = None) -> dict:
        """What a checkpoint manifest records of the GPUs: model, count, driver, bytes held.

        ``gpu_bytes`` and ``gpu_devices`` cover ``pids`` when given. Empty values without
        NVML (a CPU-only host).
        """
        nv = self._nvml()
        names = nv.device_names()
        held = nv.process_memory(list(pids)) if pids else {}
        return {
            "gpu_model": names[0] if names else "",
            "gpu_models": names,
            "gpu_count": len(names),
            "gpu_memory_total": nv.device_memory_total(),
            "driver_version": nv.driver_version() or "",
            "cuda_version": self.cuda_version() or "",
            "gpu_bytes": sum(sum(d.values()) for d in held.values()),
            "gpu_devices": sorted(held),
        }


def _is_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


__all__ = [
    "CudaCheckpoint",
    "CudaDriverError",
    "GpuBusy",
    "PROCESS_STATES",
]
