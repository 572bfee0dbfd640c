"""Suspend and restore a process holding N GiB of GPU data: through our code, and by hand.

For each size (GiB, from argv; default 1 8 24):

- **ours**: a detached process fills N GiB of GPU memory with random data; the local
  backend (``LocalBackend.checkpoint``: driver lock + checkpoint, ``criu dump``, checksums,
  verification, kill) suspends it and ``LocalBackend.restore`` brings it back.
  ``time_to_gpu_free_s`` is when the GPU memory was free (from the manifest),
  ``time_to_disk_s`` the whole checkpoint call, ``restore_s`` the whole restore call.
- **bare**: an identical process handled by hand in the same run: the driver calls with
  ctypes (``driver_checkpoint_s`` = lock + checkpoint, ``driver_restore_s`` = restore + unlock),
  a plain ``criu dump -t PID -D DIR`` and ``criu restore -D DIR -d``.
  ``bare_suspend_s`` = driver checkpoint + criu dump; ``bare_restore_s`` = criu restore + driver restore.
- ``intact``: the sha256 of the GPU data, computed in the process, is the same after the restore.
- ``bare_durable_suspend_s``: the bare suspension followed by ``sync`` (its image on the disk,
  as ours is when ``time_to_disk_s`` ends); ``disk_bound_s``: driver checkpoint + image bytes
  at the disk's measured write speed (see ``add_disk_bound``).

The page cache is dropped before each restore where the kernel allows it (``cold_cache``).
Needs root, an NVIDIA GPU with driver >= 570, PyTorch and CRIU >= 4.2.
Each size runs ``--repeat`` times, ours and bare alternating which goes first (the first
one pays the host memory's first touch); the row holds the medians, ``runs`` every run.
``--gpus N``: the process holds GIB on each of N GPUs (the driver checkpoints them
together); the rows then also give ``ratio_to_1gpu`` against a 1-GPU run of the same
size per GPU in the same run. ``--storage chunks``: ours uses chunk storage
(``written_bytes``: the new chunks). ``--data weights``: the GPU holds bf16 model-like
weights (``randn * 0.02``) instead of random data (which chunk storage cannot compress).

Usage: ``python bench/gpu_suspend.py [GIB ...] [--repeat N] [--gpus N] [--storage files|chunks]
[--data random|weights] [--dir DIR]`` → bench/results/gpu_suspend.json
(``gpu_suspend_<storage>_<N>gpu.json`` for other storage or GPU counts, ``_weights`` added
for weights).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, print_table, results_dir

from jupyterhub_gpusnap.checkpoint.criu import find_criu
from jupyterhub_gpusnap.checkpoint.local import LocalBackend
from jupyterhub_gpusnap.checkpoint.manifest import Manifest
from jupyterhub_gpusnap.gpu.cuda import CudaCheckpoint
from jupyterhub_gpusnap.model import Server

HERE = Path(__file__).parent
DATA = "random"  # --data: what the GPU holds (bench/gpu_holder.py)
COLUMNS = [
    "gib",
    "gpu_bytes",
    "image_bytes",
    "written_bytes",
    "time_to_gpu_free_s",
    "time_to_disk_s",
    "restore_s",
    "driver_checkpoint_s",
    "driver_restore_s",
    "bare_suspend_s",
    "bare_restore_s",
    "bare_durable_suspend_s",
    "gpu_free_ratio",
    "disk_ratio",
    "durable_disk_ratio",
    "disk_bound_ratio",
    "restore_ratio",
    "intact",
    "bare_intact",
]


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


class Holder:
    """A detached process holding GPU data (bench/gpu_holder.py)."""

    def __init__(self, gib: float, root: Path, gpus: int = 1):
        self.state = Path(tempfile.mkdtemp(dir=root, prefix="holder-"))
        log = open(self.state / "log", "w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-u",
                str(HERE / "gpu_holder.py"),
                str(gib),
                str(self.state),
                str(gpus),
                DATA,
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            cwd=self.state,
        )
        self.pid = self.proc.pid
        self.n = 0
        deadline = time.monotonic() + 300
        while not (self.state / "ready").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    "GPU holder did not start: " + (self.state / "log").read_text()[-2000:]
                )
            time.sleep(0.1)

    def checksum(self, pid: int | None = None, timeout: float = 300) -> str:
        self.n += 1
        os.kill(pid or self.pid, signal.SIGUSR1)
        path = self.state / f"checksum.{self.n}"
        deadline = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > deadline:
                raise RuntimeError("no checksum: " + (self.state / "log").read_text()[-2000:])
            time.sleep(0.05)
        return path.read_text()

    def reap(self) -> None:
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def disk_write_gbps(root: Path, gib: int = 4) -> float:
    """Sequential write bandwidth of the checkpoint disk (O_DIRECT, like a large image)."""
    path = root / "ddtest"
    t = time.monotonic()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={gib * 64}", "oflag=direct"],
        check=True,
        capture_output=True,
    )
    seconds = time.monotonic() - t
    path.unlink()
    return round(gib * 2**30 / seconds / 1e9, 2)


async def ours(gib: float, root: Path, backend: LocalBackend, gpus: int = 1) -> dict:
    h = Holder(gib, root, gpus)
    before = h.checksum()
    server = Server(user="bench", name=f"g{gib:g}", state={"pid": h.pid})
    t = time.monotonic()
    info = await backend.checkpoint(server)
    time_to_disk = time.monotonic() - t
    h.reap()
    cold = drop_caches()
    t = time.monotonic()
    pid = (await backend.restore(info)).pid
    restore_s = time.monotonic() - t
    after = h.checksum(pid)
    kill(pid)
    done = await backend.get(info.id)
    m = Manifest.load(backend.folder(info.id))
    return {
        "written_bytes": m.new_bytes if m.storage == "chunks" else m.image_bytes,
        "restore_phases": (done.extra.get("restore_phases") if done else None),
        "checkpoint_phases": {
            k: info.extra.get(k) for k in ("time_to_gpu_free_s", "dump_seconds", "seal_seconds")
        },
        "gpu_bytes": info.gpu_bytes,
        "image_bytes": info.image_bytes,
        "time_to_gpu_free_s": round(info.extra.get("time_to_gpu_free_s") or 0, 3),
        "time_to_disk_s": round(time_to_disk, 3),
        "restore_s": round(restore_s, 3),
        "intact": before == after,
        "cold_cache": cold,
    }


async def bare(gib: float, root: Path, criu: str, gpus: int = 1) -> dict:
    h = Holder(gib, root, gpus)
    before = h.checksum()
    cuda = CudaCheckpoint()
    if not cuda.available():
        sys.exit(f"CUDA driver checkpoint API unavailable: {cuda.reason}")
    images = Path(tempfile.mkdtemp(dir=root, prefix="bare-"))
    t = time.monotonic()
    await asyncio.to_thread(cuda.lock, h.pid, 0)
    await asyncio.to_thread(cuda.checkpoint, h.pid)
    driver_ckpt = time.monotonic() - t
    t = time.monotonic()
    subprocess.run(
        [criu, "dump", "-t", str(h.pid), "-D", str(images)], check=True, capture_output=True
    )
    criu_dump = time.monotonic() - t
    t = time.monotonic()
    os.sync()  # what a durable image costs on top (ours fsyncs before the server is stopped)
    bare_sync = time.monotonic() - t
    h.reap()
    image_bytes = sum(p.stat().st_size for p in images.iterdir())
    drop_caches()
    pidfile = images / "restore.pid"
    t = time.monotonic()
    subprocess.run(
        [criu, "restore", "-D", str(images), "-d", "--pidfile", str(pidfile)],
        check=True,
        capture_output=True,
    )
    criu_restore = time.monotonic() - t
    pid = int(pidfile.read_text())
    t = time.monotonic()
    await asyncio.to_thread(cuda.restore, pid)
    await asyncio.to_thread(cuda.unlock, pid)
    driver_restore = time.monotonic() - t
    after = h.checksum(pid)
    kill(pid)
    shutil.rmtree(images, ignore_errors=True)
    return {
        "bare_image_bytes": image_bytes,
        "driver_checkpoint_s": round(driver_ckpt, 3),
        "criu_dump_s": round(criu_dump, 3),
        "criu_restore_s": round(criu_restore, 3),
        "driver_restore_s": round(driver_restore, 3),
        "bare_suspend_s": round(driver_ckpt + criu_dump, 3),
        "bare_sync_s": round(bare_sync, 3),
        "bare_durable_suspend_s": round(driver_ckpt + criu_dump + bare_sync, 3),
        "bare_restore_s": round(criu_restore + driver_restore, 3),
        "bare_intact": before == after,
    }


def median(values: list[float]) -> float:
    v = sorted(values)
    mid = len(v) // 2
    if len(v) % 2:
        return v[mid]
    m = (v[mid - 1] + v[mid]) / 2
    return round(m) if all(isinstance(x, int) for x in v) else round(m, 3)


def add_disk_bound(row: dict) -> None:
    """``disk_bound_s``: the least a durable suspension that writes the image after the
    driver checkpoint can take here: that checkpoint, then the image at the disk's
    measured speed (``disk_write_GBps``, O_DIRECT); ``disk_bound_ratio`` =
    time_to_disk_s / disk_bound_s."""
    if row.get("disk_write_GBps"):
        bound = row["driver_checkpoint_s"] + row["image_bytes"] / (row["disk_write_GBps"] * 1e9)
        row["disk_bound_s"] = round(bound, 3)
        row["disk_bound_ratio"] = round(row["time_to_disk_s"] / bound, 3)


async def one_run(
    gib: float, root: Path, backend: LocalBackend, criu: str, gpus: int, bare_first: bool
) -> dict:
    if bare_first:
        b = await bare(gib, root, criu, gpus)
        o = await ours(gib, root, backend, gpus)
    else:
        o = await ours(gib, root, backend, gpus)
        b = await bare(gib, root, criu, gpus)
    row = {**o, **b, "bare_first": bare_first}
    row["gpu_free_ratio"] = round(row["time_to_gpu_free_s"] / row["driver_checkpoint_s"], 3)
    row["disk_ratio"] = round(row["time_to_disk_s"] / row["bare_suspend_s"], 3)
    row["durable_disk_ratio"] = round(row["time_to_disk_s"] / row["bare_durable_suspend_s"], 3)
    row["restore_ratio"] = round(row["restore_s"] / row["bare_restore_s"], 3)
    for c in await backend.list("bench"):
        await backend.delete(c.id)
    return row


async def main(sizes: list[float], root: Path, repeat: int, gpus: int, storage: str) -> None:
    criu = find_criu()
    if not criu:
        sys.exit("criu not found: install it with .ci/install-criu.sh")
    root.mkdir(parents=True, exist_ok=True)
    backend = LocalBackend(
        checkpoint_dir=str(root / "checkpoints"),
        criu_path=criu,
        min_free_bytes=0,
        keep_last=1,
        storage=storage,
        restore_mode="eager",  # against the bare recipe's eager restore
    )
    await backend.setup()
    disk = disk_write_gbps(root)
    about = machine()
    name = "gpu_suspend" if (storage, gpus) == ("files", 1) else f"gpu_suspend_{storage}_{gpus}gpu"
    name += "_weights" if DATA == "weights" else ""
    path = results_dir() / f"{name}.json"
    rows = []
    for gib in sizes:
        runs = []
        for r in range(repeat):
            run = await one_run(gib, root, backend, criu, gpus, bare_first=bool(r % 2))
            run["disk_write_GBps"] = disk
            add_disk_bound(run)
            runs.append(run)
            print(f"{gib:g} GiB x {gpus} GPU run {r + 1}: {run}", flush=True)
        row = {"gib": gib, "gpus": gpus, "storage": storage, "data": DATA, "repeat": repeat}
        for k, v in runs[0].items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                row[k] = all(x[k] for x in runs) if isinstance(v, bool) else v
            else:
                row[k] = median([x[k] for x in runs])
        if gpus > 1:  # the same size per GPU on one GPU, same run
            one = [
                await one_run(gib, root, backend, criu, 1, bare_first=bool(r % 2))
                for r in range(repeat)
            ]
            for k in (
                "time_to_gpu_free_s",
                "time_to_disk_s",
                "restore_s",
                "driver_checkpoint_s",
                "driver_restore_s",
            ):
                row[f"one_gpu_{k}"] = median([x[k] for x in one])
                row[f"ratio_to_1gpu_{k}"] = round(row[k] / row[f"one_gpu_{k}"], 3)
        row["runs"] = runs
        row["machine"] = about
        rows.append(row)
        path.write_text(
            json.dumps(rows, indent=2) + "\n"
        )  # after each size: a cut-off run keeps them
    print_table(rows, COLUMNS)
    if gpus > 1:
        print_table(
            rows,
            ["gib", "gpus"] + [c for c in rows[0] if c.startswith(("one_gpu_", "ratio_to_1gpu_"))],
        )
    print(f"disk write {disk} GB/s (O_DIRECT)")
    print(f"wrote {path}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("sizes", nargs="*", type=float, default=[1, 8, 24])
    p.add_argument("--repeat", type=int, default=3, help="runs per size (medians reported)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs the process holds data on")
    p.add_argument(
        "--storage", choices=["files", "chunks"], default="files", help="LocalBackend.storage"
    )
    p.add_argument("--data", choices=["random", "weights"], default="random",
                   help="what the GPU holds: random int32, or bf16 weights (randn * 0.02)")  # fmt: skip
    p.add_argument("--dir", default="/var/tmp/gpusnap-bench")
    a = p.parse_args()
    DATA = a.data
    asyncio.run(main(a.sizes, Path(a.dir), a.repeat, a.gpus, a.storage))
