"""GPU signal from NVML: how hard a server's processes use the GPU, and how much memory they hold.

A server is mapped to GPU work by its process tree (the spawner's pid and all its
descendants). Utilisation is per process (``nvmlDeviceGetProcessUtilization``), so a
server sharing a GPU with another is judged by its own work; memory held is reported
but is not activity (an idle kernel can hold gigabytes at 0 %).

On a machine without NVML (no NVIDIA driver) the source says nothing about the GPU
and raises no error: CPU-only hubs keep working.
"""

from __future__ import annotations

import asyncio

from traitlets import Any as AnyTrait
from traitlets import Bool

from ..gpu.nvml import Nvml
from ..model import Sample, Server
from ..procs import tree_pids
from .base import SignalSource


class NvmlSignal(SignalSource):
    """GPU activity of a server's process tree, read from NVML on this host.

    Fills ``gpu_percent`` (max per-process SM utilisation since the previous reading),
    ``gpu_memory_bytes`` (memory the tree holds) and ``gpu_count`` (devices it uses).
    Without NVML the three fields stay None and no error is recorded.
    """

    name = "gpu"

    device_fallback = Bool(
        True,
        help="""When NVML has no per-process utilisation for a device where the server
        holds GPU memory (some GPUs and drivers do not support it), use the whole device's
        utilisation (nvmlDeviceGetUtilizationRates) instead. Right on a GPU dedicated to one
        server; on a GPU shared by several servers it attributes other users' work to this
        server, which can keep an idle server from being suspended. Set False on shared GPUs
        to report the GPU as unknown instead.""",
    ).tag(config=True)

    nvml = AnyTrait(
        None,
        help="An Nvml instance to share with other parts; made on setup() when None.",
    )

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._since: dict[tuple[str, int], int] = {}
        self._told_absent = False

    async def setup(self) -> None:
        if self.nvml is None:
            self.nvml = Nvml()
        ok = await asyncio.to_thread(self.nvml.open)
        if not ok:
            self._log_absent()
        else:
            self.log.info("GPU signal: NVML on %d device(s)", self.nvml.device_count)

    async def close(self) -> None:
        if self.nvml is not None:
            await asyncio.to_thread(self.nvml.close)

    def _log_absent(self) -> None:
        if not self._told_absent:
            self._told_absent = True
            self.log.info("no GPU signal: NVML not available (%s)", self.nvml.reason)

    async def read(self, server: Server, now: float) -> Sample:
        if self.nvml is None:
            await self.setup()
        if not self.nvml.available:
            self._log_absent()
            return Sample(time=now)
        if server.pid is None:
            return Sample(
                time=now,
                errors={
                    self.name: "no pid in the spawner state (the service needs admin:server_state)"
                },
            )
        return await asyncio.to_thread(self._read_sync, server, now)

    def _read_sync(self, server: Server, now: float) -> Sample:
        pids = tree_pids(server.pid)
        if not pids:
            return Sample(time=now, errors={self.name: f"process {server.pid} is gone"})
        memory = self.nvml.process_memory(pids)
        percents: list[float] = []
        unknown = False
        for index in range(self.nvml.device_count):
            since = self._since.get((server.key, index), 0)
            util, newest = self.nvml.process_utilization(index, pids, since)
            self._since[(server.key, index)] = newest
            if util is not None:
                percents.append(float(util))
            elif index in memory:
                if self.device_fallback:
                    percents.append(float(self.nvml.device_utilization(index)))
                else:
                    unknown = True
        held = sum(sum(per_pid.values()) for per_pid in memory.values())
        if unknown and not percents:
            percent = None
        else:
            percent = max(percents, default=0.0)
        self.log.debug(
            "gpu %s: %s%% SM, %d bytes on %d device(s)", server.key, percent, held, len(memory)
        )
        return Sample(time=now, gpu_percent=percent, gpu_memory_bytes=held, gpu_count=len(memory))
