"""Parking a server's GPU memory in host RAM, and making room on a GPU by parking idle servers.

The watcher's executor hands the policy's ``park`` and ``unpark`` effects to
:meth:`Room.park`; make-room (the admin API, ``POST api/make-room``, and each tick's
``Watcher.min_free_gpu_memory``) parks idle servers, the longest idle first, until a GPU
has the memory asked for. A server parked to make room moves to ``parked`` through the
policy's ``parked`` transition, a refused park to ``idle`` through ``park_refused``.
"""

from __future__ import annotations

import asyncio
import time

from . import metrics
from .errors import CheckpointRefused
from .gpu.view import GpuReading, GpuView, local_gpus, pick
from .model import Server, State
from .policy import ServerStatus
from .procs import tree_pids


class Room:
    """Parks and unparks servers for one :class:`~.watcher.Watcher` (its ``room``): the
    watcher's servers, store, backend, clock and settings, and its executor for the
    transitions a park makes."""

    def __init__(self, watcher):
        self.watcher = watcher
        self._cuda = None
        self._lock = asyncio.Lock()  # one make-room at a time (API and ticks)
        # (node, GPU) below min_free_gpu_memory with nothing to park; nodes whose GPU memory
        # the last reading could not read
        self._short_gpus: set[tuple[str, int]] = set()
        self._gpu_missing: set[str] = set()
        self._free_labels: set[tuple[str, str]] = set()  # gpusnap_gpu_free_bytes children set
        self._told_no_gpu = False

    @property
    def log(self):
        return self.watcher.log

    @property
    def cuda(self):
        """The CUDA checkpoint layer used for parking (one per service; a no-op without a driver)."""
        if self._cuda is None:
            from .gpu.cuda import CudaCheckpoint

            self._cuda = CudaCheckpoint(parent=self.watcher)
        return self._cuda

    async def park(
        self,
        server: Server,
        status: ServerStatus,
        unpark: bool = False,
        reason: str = "",
        detail: dict | None = None,
    ):
        """Park (or unpark) a server's GPU memory; returns the ParkResult, or None if refused/failed."""
        from .gpu.park import park
        from .gpu.park import unpark as do_unpark

        action = "unpark" if unpark else "park"
        # a backend whose servers run elsewhere (Kubernetes: the node agent) parks them itself
        backend = self.watcher.backend
        remote = backend.park if backend is not None and backend.supports_park else None
        t0 = time.perf_counter()
        try:
            if remote is not None:
                result = await remote(server, unpark=unpark)
            else:
                pids = tree_pids(server.pid)
                result = await (do_unpark(pids, self.cuda) if unpark else park(pids, self.cuda))
        except CheckpointRefused as e:
            metrics.ACTIONS.labels(action=action, result="refused").inc()
            self.log.info("%s: %s refused: %s", server.key, action, e)
            if not unpark:
                self.watcher.execute(status, "park_refused", f"park refused: {e}")
            return None
        except Exception as e:
            metrics.ACTIONS.labels(action=action, result="failed").inc()
            metrics.FAILURES.labels(kind=action).inc()
            self.log.error("%s: %s failed: %s", server.key, action, e)
            return None
        metrics.ACTION_SECONDS.labels(action=action).observe(time.perf_counter() - t0)
        metrics.ACTIONS.labels(action=action, result="ok").inc()
        event = {
            "bytes": result.bytes_moved,
            "seconds": round(result.seconds, 3),
            "pids": result.pids,
        }
        if reason:
            event["reason"] = reason
        event.update(detail or {})
        self.watcher.store.record_event(server.key, action, event)
        return result

    @property
    def nvml(self):
        """NVML as the CUDA checkpoint layer uses it (GPU free memory and per-process memory)."""
        cuda = self.cuda
        if cuda.nvml is None:
            from .gpu.nvml import Nvml

            cuda.nvml = Nvml()
        return cuda.nvml

    def _candidates(
        self, now: float, min_idle: float
    ) -> list[tuple[float, str, Server, ServerStatus]]:
        """Servers make-room may park: idle by every signal for ``min_idle`` s, holding GPU memory."""
        out = []
        watcher = self.watcher
        with watcher.store.batch(preload=True):  # one read of every row (joins a tick's batch)
            for key, server in watcher.servers.items():
                status = watcher.store.get(key)
                if (
                    status is None
                    or status.state not in (State.idle, State.warned)
                    or watcher.suspending(key)
                ):
                    continue
                held = (status.last_sample or {}).get("gpu_memory_bytes") or 0
                idle_since = max(status.last_active, status.started, status.restored_at or 0.0)
                if held > 0 and now - idle_since >= min_idle:
                    out.append((status.last_active, key, server, status))
        out.sort(key=lambda c: (c[0], c[1]))
        return out

    async def _gpu_view(self, servers: list[Server]) -> GpuReading:
        """Every GPU's free memory and the bytes each of ``servers`` holds on it.

        From the backend where servers run elsewhere (Kubernetes: the node agents, per
        node), else from NVML on this machine (servers by their process trees). No GPUs,
        with the reason, where GPU memory cannot be freed (no NVML, or no CUDA
        checkpoint API here).
        """
        backend = self.watcher.backend
        remote = backend.gpu_memory if backend is not None and backend.supports_gpu_memory else None
        if remote is not None:
            reading = await remote(servers)
        elif not self.cuda.available():
            reading = GpuReading(missing={"": self.cuda.reason or "no CUDA checkpoint API"})
        else:
            gpus = await asyncio.to_thread(local_gpus, self.nvml, servers)
            reading = GpuReading(gpus, {} if gpus else {"": self.nvml.reason or "no GPU"})
        if reading.gpus:  # some GPUs read: say which nodes could not be, when that changes
            missing = set(reading.missing)
            for place in sorted(missing - self._gpu_missing):
                self.log.warning(
                    "free GPU memory of node %s not read: %s", place or "?", reading.missing[place]
                )
            for place in sorted(self._gpu_missing - missing):
                self.log.info("free GPU memory of node %s read again", place or "?")
            self._gpu_missing = missing
        return reading

    async def make_room(self, nbytes: int, gpu: int | None = None, node: str | None = None,
                        min_idle: float = 0.0, trigger: str = "api") -> dict:  # fmt: skip
        """Park idle servers, the longest idle first, until ``nbytes`` of GPU memory are freed.

        Only servers idle by every signal (``idle`` or ``warned``) for at least ``min_idle``
        seconds that hold GPU memory are candidates; active, exempt and kept-running servers
        are never parked, and a server whose GPU is busy refuses (the driver lock times
        out). With ``gpu`` (a device index) and/or ``node`` (a Kubernetes node name) only
        servers holding memory on those GPUs count, and only their bytes on them. On a hub
        with GPUs on several nodes, ``gpu`` needs ``node``: :class:`RoomRequestError` says
        so, as it does for a node with no known GPU. ``trigger`` (api,
        min_free_gpu_memory) labels the metrics and the park events.
        """
        async with self._lock:
            candidates = self._candidates(self.watcher.clock(), min_idle)
            if gpu is None and node is None:
                return await self._park_for_room(nbytes, candidates, None, {}, trigger)
            reading = await self._gpu_view([c[2] for c in candidates])
            views = pick(reading.gpus, gpu, node)
            held: dict[str, int] = {}
            for view in views:
                for key, n in view.held.items():
                    held[key] = held.get(key, 0) + n
            place: dict = {} if gpu is None else {"gpu": gpu}
            nodes = {v.node for v in views}
            if node is not None:
                place["node"] = node
            elif len(nodes) == 1 and "" not in nodes:
                place["node"] = nodes.pop()  # the hub's only GPU node
            return await self._park_for_room(nbytes, candidates, held, place, trigger)

    async def _park_for_room(self, nbytes: int, candidates: list, held: dict[str, int] | None, place: dict,
                             trigger: str) -> dict:  # fmt: skip
        """Park ``candidates`` in order until ``nbytes`` are freed (callers hold _lock).

        ``held``: each server's bytes on the GPUs asked about (only those servers are
        parked, and only those bytes count); None: any GPU, counting the bytes each park
        moved. ``place`` (``gpu``, ``node``) goes into the events and the answer.
        """
        where = ""
        if "gpu" in place:
            where += f" on GPU {place['gpu']}"
        if place.get("node"):
            where += f" of node {place['node']}" if "gpu" in place else f" on node {place['node']}"
        freed, parked = 0, []
        for _, key, server, status in candidates:
            if freed >= nbytes:
                break
            if (held is not None and not held.get(key)) or status.state not in (
                State.idle,
                State.warned,
            ):
                continue  # not on these GPUs, or parked meanwhile to make room on another
            result = await self.park(server, status, reason=f"make room for {nbytes} bytes{where}",
                                     detail={"trigger": trigger, **place})  # fmt: skip
            if result is not None and result.bytes_moved:
                freed += held[key] if held is not None else result.bytes_moved
                parked.append(key)
                self.watcher.execute(
                    status, "parked", f"parked to make room on the GPU ({trigger})"
                )
        enough = freed >= nbytes
        metrics.MAKE_ROOM.labels(trigger=trigger, result="enough" if enough else "short").inc()
        if freed:
            metrics.MAKE_ROOM_BYTES.labels(trigger=trigger).inc(freed)
        if parked or trigger == "api":
            self.log.info("make room for %d bytes%s (%s): freed %d by parking %s", nbytes, where, trigger,
                          freed, ", ".join(parked) or "nothing")  # fmt: skip
        return {
            "requested_bytes": nbytes,
            "freed_bytes": freed,
            "parked": parked,
            "enough": enough,
            **place,
        }

    def _export_free(self, gpus: list[GpuView]) -> None:
        """gpusnap_gpu_free_bytes{node, gpu} of each GPU read; GPUs no longer read are dropped."""
        seen = {(v.node, str(v.index)) for v in gpus}
        for labels in self._free_labels - seen:
            try:
                metrics.GPU_FREE_BYTES.remove(*labels)
            except KeyError:
                pass
        self._free_labels = seen
        for view in gpus:
            metrics.GPU_FREE_BYTES.labels(node=view.node, gpu=str(view.index)).set(view.free_bytes)

    async def keep_gpu_free(self) -> list[dict]:
        """Make room on each GPU with less free memory than ``Watcher.min_free_gpu_memory``.

        Called once per tick; returns the make-room result of each GPU that was short
        (on Kubernetes, each GPU of each node, read from the node agents). Does nothing
        when the setting is 0, or without NVML or the driver's checkpoint API.
        """
        target, min_idle = self.watcher.min_free_gpu_memory, self.watcher.min_free_gpu_memory_idle
        if target <= 0:
            return []
        async with self._lock:
            candidates = self._candidates(self.watcher.clock(), min_idle)
            servers = [c[2] for c in candidates]
            backend = self.watcher.backend
            local = backend is None or not backend.supports_gpu_memory
            # on this machine, who holds what (a /proc walk per server) only once a GPU is short
            reading = await self._gpu_view([] if local else servers)
            if local and servers and any(v.free_bytes < target for v in reading.gpus):
                reading = await self._gpu_view(servers)
            self._export_free(reading.gpus)
            if not reading.gpus:
                if not self._told_no_gpu:
                    self._told_no_gpu = True
                    self.log.info("min_free_gpu_memory is set but GPU memory cannot be freed here (%s)",
                                  reading.why_none())  # fmt: skip
                return []
            results, parked = [], set()
            for view in reading.gpus:
                gpu = (view.node, view.index)
                # servers parked for an earlier GPU of this pass freed their bytes on this one too
                have = view.free_bytes + sum(view.held.get(key, 0) for key in parked)
                if have >= target:
                    if gpu in self._short_gpus:
                        self._short_gpus.discard(gpu)
                        self.log.info(
                            "%s: %d bytes free, min_free_gpu_memory %d met again",
                            view.label,
                            have,
                            target,
                        )
                    continue
                if not view.can_park:
                    if gpu not in self._short_gpus:
                        self._short_gpus.add(gpu)
                        self.log.warning(
                            "%s: %d bytes free, below min_free_gpu_memory %d, but its node has no CUDA "
                            "checkpoint API to park with (NVIDIA driver >= 570 needed)", view.label, have, target,
                        )  # fmt: skip
                    continue
                place = {"gpu": view.index, "node": view.node} if view.node else {"gpu": view.index}
                result = await self._park_for_room(
                    target - have, candidates, view.held, place, "min_free_gpu_memory"
                )
                parked.update(result["parked"])
                results.append(result)
                if not result["enough"] and gpu not in self._short_gpus:
                    self._short_gpus.add(gpu)  # said once per shortage, not every tick
                    self.log.warning(
                        "%s: %d bytes free, below min_free_gpu_memory %d, and no other server idle for "
                        "min_free_gpu_memory_idle (%gs) holds memory on it",
                        view.label, have + result["freed_bytes"], target, min_idle,
                    )  # fmt: skip
            return results
