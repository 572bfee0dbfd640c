"""NVML, opened once per process: the GPUs of this host, their memory, and per-process use.

The watcher, the CUDA checkpoint layer, the GPU view and the node agent all read the GPU
through :class:`Nvml`; the activity signal (:mod:`jupyterhub_gpusnap.signals.nvml`) is one
user of it. On a machine without NVML (no NVIDIA driver) nothing here raises:
:attr:`Nvml.available` is False and :attr:`Nvml.reason` says why.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

_SHARED: Nvml | None = None  # Nvml.shared()
_SHARED_LOCK = threading.Lock()

# NVML return codes used below (nvml.h)
_NVML_SUCCESS = 0
_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_ERROR_NOT_FOUND = 6


@dataclass
class _DeviceSamples:
    """Per-process utilisation samples NVML handed us for one device, newest last."""

    last_seen: int = 0  # NVML timestamp (µs) of the newest sample read so far
    samples: deque = field(default_factory=lambda: deque(maxlen=4096))  # (timestamp, pid, smUtil)
    supported: bool = True


class Nvml:
    """NVML opened once for the whole process, with the few queries the project needs.

    ``module`` is ``pynvml`` (from nvidia-ml-py) unless another object with the same
    function names is given. Every method is blocking: call it from a thread.
    Nothing here raises when NVML is missing: :attr:`available` is False and
    :attr:`reason` says why.
    """

    @classmethod
    def shared(cls) -> Nvml:
        """The process's own instance (pynvml), for the users that only ask for inventory
        and memory: the Hub makes a CUDA layer per spawner, and each opened NVML anew."""
        with _SHARED_LOCK:
            global _SHARED
            if _SHARED is None:
                _SHARED = cls()
            return _SHARED

    def __init__(self, module: Any = None):
        self._module = module
        self._lock = threading.Lock()
        self._opened = False
        self.available = False
        self.reason = ""
        self._handles: list[Any] = []
        self._devices: dict[int, _DeviceSamples] = {}

    def open(self) -> bool:
        """Initialise NVML once; True when it is usable."""
        with self._lock:
            if self._opened:
                return self.available
            self._opened = True
            try:
                if self._module is None:
                    import pynvml

                    self._module = pynvml
                nv = self._module
                nv.nvmlInit()
                count = nv.nvmlDeviceGetCount()
                self._handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
                self._devices = {i: _DeviceSamples() for i in range(count)}
                self.available = True
            except Exception as e:  # ImportError, NVMLError_LibraryNotFound, driver mismatch…
                self.reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                self.available = False
            return self.available

    def close(self) -> None:
        with self._lock:
            if self._opened and self.available:
                try:
                    self._module.nvmlShutdown()
                except Exception:
                    pass
            self._opened = False
            self.available = False

    @property
    def device_count(self) -> int:
        return len(self._handles)

    def driver_version(self) -> str | None:
        if not self.open():
            return None
        v = self._module.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)

    def device_names(self) -> list[str]:
        if not self.open():
            return []
        names = []
        for h in self._handles:
            n = self._module.nvmlDeviceGetName(h)
            names.append(n.decode() if isinstance(n, bytes) else str(n))
        return names

    def device_uuids(self) -> list[str]:
        """Each GPU's UUID (``GPU-…``) by device index, ``""`` where NVML does not give it."""
        if not self.open():
            return []
        out = []
        for h in self._handles:
            try:
                u = self._module.nvmlDeviceGetUUID(h)
                out.append(u.decode() if isinstance(u, bytes) else str(u))
            except Exception:  # not supported by this driver or NVML build
                out.append("")
        return out

    def device_memory_total(self) -> list[int]:
        if not self.open():
            return []
        return [int(self._module.nvmlDeviceGetMemoryInfo(h).total) for h in self._handles]

    def device_memory_free(self) -> list[int]:
        """Free memory (bytes) of each GPU, by device index; [] without NVML."""
        if not self.open():
            return []
        return [int(self._module.nvmlDeviceGetMemoryInfo(h).free) for h in self._handles]

    def process_memory(self, pids: list[int]) -> dict[int, dict[int, int]]:
        """GPU memory held by each of ``pids``, per device index: ``{device: {pid: bytes}}``.

        Only devices where at least one of the pids has a context appear. A pid whose
        usage NVML cannot tell (``usedGpuMemory`` None) counts as 0 bytes but its
        device still appears.
        """
        if not self.open():
            return {}
        wanted = set(pids)
        out: dict[int, dict[int, int]] = {}
        for i, h in enumerate(self._handles):
            try:
                procs = self._module.nvmlDeviceGetComputeRunningProcesses(h)
            except Exception:
                continue
            for p in procs:
                if p.pid in wanted:
                    used = p.usedGpuMemory or 0
                    out.setdefault(i, {})[p.pid] = out.get(i, {}).get(p.pid, 0) + int(used)
        return out

    def _pull_samples(self, index: int) -> None:
        """Append the device's per-process samples newer than the last ones read."""
        dev = self._devices[index]
        if not dev.supported:
            return
        nv = self._module
        try:
            samples = nv.nvmlDeviceGetProcessUtilization(self._handles[index], dev.last_seen)
        except Exception as e:
            code = getattr(e, "value", None)
            if code == _NVML_ERROR_NOT_SUPPORTED:
                dev.supported = False
            # NOT_FOUND (or a bare SUCCESS with no samples): nothing new since last_seen
            return
        for s in samples:
            dev.samples.append((int(s.timeStamp), int(s.pid), int(s.smUtil)))
            dev.last_seen = max(dev.last_seen, int(s.timeStamp))

    def process_utilization(
        self, index: int, pids: list[int], since: int
    ) -> tuple[int | None, int]:
        """Max SM utilisation of ``pids`` on device ``index`` in samples newer than ``since``.

        Returns ``(percent or None when no sample of these pids exists, newest timestamp)``;
        pass the returned timestamp back as ``since`` next time. Samples are kept per
        device and shared, so many servers on one GPU each see every sample.
        """
        with self._lock:
            self._pull_samples(index)
            dev = self._devices[index]
            wanted = set(pids)
            best: int | None = None
            for ts, pid, sm in dev.samples:
                if ts > since and pid in wanted:
                    best = sm if best is None else max(best, sm)
            return best, dev.last_seen

    def utilization_supported(self, index: int) -> bool:
        return self._devices[index].supported

    def device_utilization(self, index: int) -> int:
        """Whole-device utilisation percent (all processes of all users)."""
        return int(self._module.nvmlDeviceGetUtilizationRates(self._handles[index]).gpu)
