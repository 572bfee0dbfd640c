"""How long parking takes: GPU memory to host RAM and back, per size of GPU data.

For each size (GiB, from argv; default 1 8 24) a PyTorch process fills that much GPU
memory with random data. The bench then measures, on the same process:

- ``park_s`` / ``unpark_s``: :func:`jupyterhub_gpusnap.gpu.park.park` and ``unpark``, as
  the service calls them (NVML look-up and host-RAM check included);
- ``driver_checkpoint_s`` / ``driver_restore_s`` (and lock/unlock): the bare
  ``cuCheckpointProcess*`` calls made directly with ctypes, for comparison;
- ``intact``: the data's sha256, computed inside the process, matches after both.

Park runs first, the bare driver calls second (host buffers may then be warm).
Needs an NVIDIA GPU, driver >= 570 and PyTorch. Usage: ``python bench/park.py [GIB ...]``.
"""

from __future__ import annotations

import asyncio
import ctypes
import sys
import time

from common import print_table, write_json

from jupyterhub_gpusnap.gpu.cuda import (
    CUcheckpointCheckpointArgs,
    CUcheckpointLockArgs,
    CUcheckpointRestoreArgs,
    CUcheckpointUnlockArgs,
    CudaCheckpoint,
)
from jupyterhub_gpusnap.gpu.park import park, unpark
from tests.helpers.gpu_helpers import GpuProcess

COLUMNS = [
    "gib",
    "gpu_bytes",
    "park_s",
    "unpark_s",
    "driver_lock_s",
    "driver_checkpoint_s",
    "driver_restore_s",
    "driver_unlock_s",
    "park_gb_per_s",
    "unpark_gb_per_s",
    "intact",
]


def bare_driver_round_trip(pid: int) -> dict:
    """Lock, checkpoint, restore, unlock ``pid`` with direct ctypes calls; seconds of each."""
    lib = ctypes.CDLL("libcuda.so.1")
    assert lib.cuInit(0) == 0
    lock = CUcheckpointLockArgs()
    lock.timeoutMs = 5000
    steps = [
        ("driver_lock_s", lib.cuCheckpointProcessLock, lock),
        ("driver_checkpoint_s", lib.cuCheckpointProcessCheckpoint, CUcheckpointCheckpointArgs()),
        ("driver_restore_s", lib.cuCheckpointProcessRestore, CUcheckpointRestoreArgs()),
        ("driver_unlock_s", lib.cuCheckpointProcessUnlock, CUcheckpointUnlockArgs()),
    ]
    out = {}
    for name, fn, args in steps:
        t = time.perf_counter()
        rc = fn(ctypes.c_int(pid), ctypes.byref(args))
        out[name] = time.perf_counter() - t
        if rc != 0:
            raise RuntimeError(f"{name} on pid {pid}: CUresult {rc}")
    return out


async def one(gib: float, cuda: CudaCheckpoint) -> dict:
    proc = GpuProcess(["hold", "--gib", str(gib)])
    try:
        before = proc.checksum()
        gpu_bytes = cuda.gpu_memory_of([proc.pid])
        t = time.perf_counter()
        parked = await park([proc.pid], cuda, lock_timeout_ms=5000)
        park_s = time.perf_counter() - t
        t = time.perf_counter()
        back = await unpark([proc.pid], cuda)
        unpark_s = time.perf_counter() - t
        assert parked.pids == [proc.pid] and back.pids == [proc.pid], (parked, back)
        intact_park = proc.checksum() == before
        bare = await asyncio.to_thread(bare_driver_round_trip, proc.pid)
        intact = intact_park and proc.checksum() == before
    finally:
        proc.stop()
    gb = gpu_bytes / 1e9
    return {
        "gib": gib,
        "gpu_bytes": gpu_bytes,
        "park_s": park_s,
        "unpark_s": unpark_s,
        **bare,
        "park_gb_per_s": gb / park_s,
        "unpark_gb_per_s": gb / unpark_s,
        "intact": intact,
    }


async def main(sizes: list[float]) -> None:
    cuda = CudaCheckpoint()
    if not cuda.available():
        sys.exit(f"no CUDA checkpoint API here: {cuda.reason}")
    rows = []
    for gib in sizes:
        rows.append(await one(gib, cuda))
        print(f"{gib:g} GiB done", flush=True)
    print_table(rows, COLUMNS)
    write_json(
        "park", rows, sizes_gib=sizes, driver=cuda.driver_version(), cuda=cuda.cuda_version()
    )


if __name__ == "__main__":
    sizes = [float(a) for a in sys.argv[1:]] or [1.0, 8.0, 24.0]
    asyncio.run(main(sizes))
