"""Park: move an idle server's GPU memory to host RAM while the server keeps running.

A parked server frees its GPU at once (for others, or for a later CRIU dump) and
answers the user as before; only its next GPU call waits until :func:`unpark` has
copied the memory back. Parking is the cheap first step of a suspension and the
whole of it where a server may stay in memory.

:func:`park` and :func:`unpark` are plain functions over a
:class:`~jupyterhub_gpusnap.gpu.cuda.CudaCheckpoint`; :class:`Parking` holds
the settings an admin tunes.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field

import psutil
from traitlets import Integer
from traitlets.config import LoggingConfigurable

from ..errors import CheckpointRefused
from .cuda import CudaCheckpoint

GiB = 1024**3

DEFAULT_HOST_MARGIN = 2 * GiB


@dataclass
class ParkResult:
    """What a park or unpark did: the pids handled, the GPU bytes moved, the time taken."""

    pids: list[int] = field(default_factory=list)
    bytes_moved: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def check_host_memory(gpu_bytes: int, available_bytes: int, margin_bytes: int) -> None:
    """Refuse to park when host RAM cannot take ``gpu_bytes`` and still keep ``margin_bytes`` free.

    The driver copies GPU memory into the process's own host memory; running the host
    out of memory would get the server (or another) killed, losing the very state
    parking is meant to keep.
    """
    need = gpu_bytes + margin_bytes
    if gpu_bytes > 0 and available_bytes < need:
        raise CheckpointRefused(
            f"not enough host RAM to park: {gpu_bytes / GiB:.1f} GiB of GPU memory to move, "
            f"{available_bytes / GiB:.1f} GiB available, {margin_bytes / GiB:.1f} GiB kept free; "
            "free host memory, add swap, or lower Parking.host_memory_margin",
            retry=True,
        )


async def park(
    pids: list[int],
    cuda: CudaCheckpoint,
    lock_timeout_ms: int = 5000,
    host_margin_bytes: int = DEFAULT_HOST_MARGIN,
) -> ParkResult:
    """Move the GPU memory of ``pids`` to host RAM; the processes keep running.

    Idempotent (pids already parked are reported again, with nothing moved for them);
    pids without a CUDA context and pids that exit meanwhile are skipped. Raises
    :class:`~jupyterhub_gpusnap.gpu.cuda.GpuBusy` (retry later) when a cell is
    running on the GPU, :class:`CheckpointRefused` when host RAM is short; in both
    cases nothing changed. Without a CUDA driver: an empty result.
    """
    if not cuda.available():
        await cuda.suspend(pids)  # logs once why GPU checkpointing is off
        return ParkResult()
    held = await asyncio.to_thread(cuda.gpu_memory_by_pid, pids)
    if held:
        # Only processes holding GPU memory (and those already parked): a process that merely
        # loaded the driver — the single-user server running auto-unpark — must stay unlocked
        # so that it can unpark its kernels.
        pids = [p for p in pids if p in held or cuda.state(p) in ("checkpointed", "locked")]
    gpu_bytes = sum(held.values())
    check_host_memory(gpu_bytes, psutil.virtual_memory().available, host_margin_bytes)
    start = time.perf_counter()
    moved = await cuda.suspend(pids, lock_timeout_ms)
    seconds = time.perf_counter() - start
    if moved:
        cuda.log.info(
            "parked pids %s: %.2f GiB to host RAM in %.2fs", moved, gpu_bytes / GiB, seconds
        )
    return ParkResult(pids=moved, bytes_moved=gpu_bytes, seconds=seconds)


async def unpark(pids: list[int] | None, cuda: CudaCheckpoint) -> ParkResult:
    """Copy parked GPU memory back and let the processes use the GPU again.

    Idempotent: running pids and pids that exited are skipped. ``None`` unparks every
    pid ``cuda`` parked. On a failed restore the process stays parked (its data safe
    in host RAM) and :class:`~jupyterhub_gpusnap.checkpoint.base.CheckpointError` says
    what to free.
    """
    if not cuda.available():
        await cuda.resume(pids)
        return ParkResult()
    start = time.perf_counter()
    resumed = await cuda.resume(pids)
    seconds = time.perf_counter() - start
    gpu_bytes = await asyncio.to_thread(cuda.gpu_memory_of, resumed) if resumed else 0
    if resumed:
        cuda.log.info(
            "unparked pids %s: %.2f GiB back on the GPU in %.2fs", resumed, gpu_bytes / GiB, seconds
        )
    return ParkResult(pids=resumed, bytes_moved=gpu_bytes, seconds=seconds)


class Parking(LoggingConfigurable):
    """The admin's settings for parking, and :func:`park`/:func:`unpark` bound to them."""

    host_memory_margin = Integer(
        DEFAULT_HOST_MARGIN,
        help="""Bytes of host RAM that must stay available after a park. A park that would
        leave less is refused (the server keeps its GPU and is tried again later), so that
        moving GPU memory to the host never drives the host out of memory. Default 2 GiB;
        raise it on hosts that run many servers.""",
    ).tag(config=True)

    lock_timeout_ms = Integer(
        5000,
        help="""Milliseconds to wait for running GPU work before a park gives up with 'GPU
        busy' (retried on a later tick).""",
    ).tag(config=True)

    def __init__(self, cuda: CudaCheckpoint | None = None, **kwargs):
        super().__init__(**kwargs)
        self.cuda = cuda if cuda is not None else CudaCheckpoint(parent=self)

    async def park(self, pids: list[int]) -> ParkResult:
        return await park(pids, self.cuda, self.lock_timeout_ms, self.host_memory_margin)

    async def unpark(self, pids: list[int] | None) -> ParkResult:
        return await unpark(pids, self.cuda)
