"""Snapshot size and speed: chunk storage (zstd, shared chunks) against raw CRIU images.

For each kind of data (``weights``: bf16 model weights; ``random``: the worst case) a
detached process holds GIB GiB in host memory (bench/mem_holder.py) and is checkpointed
and restored through ``LocalBackend``:

- ``files``: CRIU's raw image files (checksummed, fsync'ed) — the baseline;
- ``chunks``: the same process again, stored as compressed, content-addressed chunks;
- ``chunks, again``: suspended a second time (what a server idle twice costs);
- ``chunks, again, unpacked first``: a third time, restored with
  ``restore_streaming = False`` (the whole image unpacked to memory before CRIU runs);
- ``chunks, user 2`` / ``user 3``: other processes holding the same weights (the same
  model loaded by several users).

``written_bytes`` is what reached the disk for the image (raw: the image; chunks: the
new chunks), ``suspend_s`` the whole checkpoint call (dump, checksums/compression,
durable), ``restore_s`` the whole restore call with the image dropped from the page
cache first (``posix_fadvise``), so the restore reads the disk; ``restore_criu_s`` the
part of it CRIU ran (streamed: reading the chunks happens meanwhile). Ratios are to the
``files`` row of the same data in the same run. ``intact``: the data's sha256 after the
restore equals the one before.

``waited_storage_s`` / ``waited_criu_s``: what a streamed restore's senders waited for —
the next chunk (reading, checking, decoding: the store is the bound) or room in the pipe
(CRIU is). ``pipe_kib``: the pipe a streamed restore fed CRIU through (``LocalBackend.restore_pipe_bytes``,
capped by ``/proc/sys/fs/pipe-max-size`` without CAP_SYS_RESOURCE; the JSON has that limit).

Usage: ``python bench/storage.py [--gib 4] [--kinds weights random] [--dir DIR] [--warm]
[--name NAME] [--restores N]`` → bench/results/storage.json (``--warm``: the image left in the page cache
before each restore, which separates reading the disk from the rest → storage_warm.json;
``--name``: another file name; ``--restores``: each checkpoint restored N times — once
right after it was taken, then in turns across the rows (files, chunks, chunks again, …,
files, chunks, …) so that a machine whose speed drifts during the run slows every row
alike; the restored process killed in between — and ``restore_s`` their median,
``restore_min_s`` / ``restore_max_s`` the fastest and slowest, ``intact`` true only if
every restore was).
Needs root and CRIU >= 4.2.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import print_table, write_json

from jupyterhub_gpusnap.checkpoint.criu import find_criu
from jupyterhub_gpusnap.checkpoint.local import LocalBackend
from jupyterhub_gpusnap.checkpoint.manifest import Manifest, drop_cached
from jupyterhub_gpusnap.model import Server

HERE = Path(__file__).parent
COLUMNS = [
    "kind",
    "gib",
    "mode",
    "image_bytes",
    "written_bytes",
    "written_ratio",
    "suspend_s",
    "suspend_ratio",
    "restore_s",
    "restore_min_s",
    "restore_max_s",
    "restore_ratio",
    "restore_criu_s",
    "waited_storage_s",
    "waited_criu_s",
    "pipe_kib",
    "intact",
]


class Holder:
    def __init__(self, kind: str, gib: float, seed: int, root: Path):
        self.state = Path(tempfile.mkdtemp(dir=root, prefix="holder-"))
        log = open(self.state / "log", "w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-u",
                str(HERE / "mem_holder.py"),
                kind,
                str(gib),
                str(seed),
                str(self.state),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            cwd=self.state,
        )
        self.pid = self.proc.pid
        self.n = 0
        deadline = time.monotonic() + 600
        while not (self.state / "ready").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    "holder did not start: " + (self.state / "log").read_text()[-2000:]
                )
            time.sleep(0.1)
        self.how = (self.state / "ready").read_text()

    def checksum(self) -> str:
        """The holder's sha256 of its data, asked for by a signal; it numbers its answers
        (``checksum.<n>``, its count is in the memory a restore brings back)."""
        self.n += 1
        path = self.state / f"checksum.{self.n}"
        path.unlink(missing_ok=True)  # a second restore of one checkpoint counts from there again
        os.kill(self.pid, signal.SIGUSR1)
        while not path.exists():
            time.sleep(0.05)
        return path.read_text()


def drop_image(backend: LocalBackend, checkpoint_id: str) -> None:
    """Drop a checkpoint's image from the page cache: the restore reads the disk."""
    folder = backend.folder(checkpoint_id)
    m = Manifest.load(folder)
    if m.storage == "chunks":
        backend.chunk_store().drop_cached(m.key_id, m.chunks)
    else:
        drop_cached(folder)


async def cycle(backend: LocalBackend, h: Holder, name: str) -> dict:
    """Checkpoint ``h`` (its current pid) and restore it once (the next row checkpoints the
    restored process); the checkpoint's record, which :func:`restore_again` adds restores to
    and :func:`figures` turns into the row's figures."""
    before = h.checksum()
    t = time.monotonic()
    info = await backend.checkpoint(Server(user="bench", name=name, state={"pid": h.pid}))
    suspend_s = time.monotonic() - t
    try:
        h.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    rec = {"backend": backend, "holder": h, "info": info, "before": before, "asked": h.n,
           "suspend_s": suspend_s, "times": [], "phases": [], "intact": []}  # fmt: skip
    await restore_once(rec)
    return rec


async def restore_once(rec: dict) -> None:
    """Restore ``rec``'s checkpoint (its pid must be free): time it, check the data."""
    backend, h, info = rec["backend"], rec["holder"], rec["info"]
    h.n = rec["asked"]  # answers the holder had given when it was checkpointed
    if not WARM:
        await asyncio.to_thread(drop_image, backend, info.id)
    t = time.monotonic()
    pid = (await backend.restore(info)).pid
    rec["times"].append(time.monotonic() - t)
    h.pid = pid
    rec["phases"].append(Manifest.load(backend.folder(info.id)).extra.get("restore_phases") or {})
    rec["intact"].append(h.checksum() == rec["before"])


async def restore_again(rec: dict) -> None:
    """Restore ``rec``'s checkpoint once more (its pid must be free): the image is marked
    verified again (a restore marks it restored), the restored process goes after."""
    h = rec["holder"]
    folder = rec["backend"].folder(rec["info"].id)
    m = Manifest.load(folder)
    m.status = "verified"
    m.save(folder)
    await restore_once(rec)
    kill(h.pid)
    wait_gone(h.pid)


def figures(rec: dict) -> dict:
    """A checkpoint's row: restore times are the median, with the fastest and slowest."""
    m = Manifest.load(rec["backend"].folder(rec["info"].id))
    times, phases = rec["times"], rec["phases"]
    written = m.new_bytes if m.storage == "chunks" else m.image_bytes
    return {
        "image_bytes": m.image_bytes,
        "written_bytes": written,
        "stored_bytes": m.stored_bytes or m.image_bytes,
        "suspend_s": round(rec["suspend_s"], 3),
        "restore_s": round(statistics.median(times), 3),
        "restore_min_s": round(min(times), 3),
        "restore_max_s": round(max(times), 3),
        "restore_criu_s": median_of(phases, "criu_s"),
        # streamed restores: seconds the streamer waited for the store (reading, checking,
        # decoding chunks) and for CRIU; the pipe CRIU read the image through
        "waited_storage_s": median_of(phases, "stream_waited_storage_s"),
        "waited_criu_s": median_of(phases, "stream_waited_criu_s"),
        "pipe_kib": (phases[-1].get("pipe_bytes") or 0) >> 10 or None,
        "intact": all(rec["intact"]),
    }


def median_of(phases: list[dict], key: str) -> float | None:
    got = [p[key] for p in phases if p.get(key) is not None]
    return round(statistics.median(got), 3) if got else None


def wait_gone(pid: int, timeout: float = 30) -> None:
    """Until ``pid`` has gone (a restore needs its pids free)."""
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


RESTORES = 1  # --restores: each checkpoint restored this many times (median, fastest, slowest)
WARM = False  # --warm: leave the image in the page cache (separates reading the disk from the rest)


def pipe_max_size() -> int | None:
    try:
        return int(Path("/proc/sys/fs/pipe-max-size").read_text())
    except (OSError, ValueError):
        return None


async def main(gib: float, kinds: list[str], root: Path, level: int, name: str) -> None:
    criu = find_criu()
    if not criu:
        sys.exit("criu not found: install it with .ci/install-criu.sh")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    common = dict(criu_path=criu, min_free_bytes=0, keep_last=10, restore_mode="eager")
    files = LocalBackend(checkpoint_dir=str(root / "files"), storage="files", **common)
    chunks = LocalBackend(
        checkpoint_dir=str(root / "chunks"), storage="chunks", compression_level=level, **common
    )
    # the restore before streaming: the whole image unpacked to memory, then CRIU (same store)
    unpacked = LocalBackend(
        checkpoint_dir=str(root / "chunks"),
        storage="chunks",
        compression_level=level,
        restore_streaming=False,
        **common,
    )
    rows = []
    how = {}
    order: list[str] = []  # the restores, in the order they ran
    for kind in kinds:
        print(f"{kind}: starting a holder of {gib:g} GiB", flush=True)
        h = Holder(kind, gib, 1, root)
        how[kind] = h.how
        base = {"kind": kind, "gib": gib}
        recs = {}
        for mode, backend in (("files", files), ("chunks", chunks), ("chunks, again", chunks),
                              ("chunks, again, unpacked first", unpacked)):  # fmt: skip
            recs[mode] = await cycle(backend, h, kind)
            order.append(f"{kind}: {mode}")
        kill(h.pid)
        wait_gone(h.pid)
        if kind == "weights":
            for user in (2, 3):
                other = Holder(kind, gib, 1, root)
                recs[f"chunks, user {user}"] = await cycle(chunks, other, f"{kind}-{user}")
                order.append(f"{kind}: chunks, user {user}")
                kill(other.pid)
                wait_gone(other.pid)
        for r in range(1, RESTORES):  # in turns across the rows: drift hits every row alike
            for mode, rec in recs.items():
                await restore_again(rec)
                order.append(f"{kind}: {mode}")
            print(f"{kind}: restores round {r + 1} of {RESTORES} done", flush=True)
        got = [dict(base, mode=mode, **figures(rec)) for mode, rec in recs.items()]
        for row in got:
            print(f"{kind}: {row}", flush=True)
        ref = got[0]
        for row in got:
            row["written_ratio"] = round(row["written_bytes"] / ref["written_bytes"], 3)
            row["suspend_ratio"] = round(row["suspend_s"] / ref["suspend_s"], 3)
            row["restore_ratio"] = round(row["restore_s"] / ref["restore_s"], 3)
        rows += got
        print_table(got, COLUMNS)
    print()
    table = print_table(rows, COLUMNS)
    write_json(
        name or ("storage_warm" if WARM else "storage"),
        rows,
        data=how,
        compression_level=level,
        table=table,
        average_chunk_bytes=chunks.average_chunk_bytes,
        cold_cache=not WARM,
        restores=RESTORES,
        restore_order=order,
        pipe_max_size=pipe_max_size(),
        restore_pipe_bytes=chunks.restore_pipe_bytes,
    )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=4)
    p.add_argument("--kinds", nargs="*", default=["weights", "random"])
    p.add_argument("--level", type=int, default=1, help="LocalBackend.compression_level")
    p.add_argument("--dir", default="/var/tmp/gpusnap-storage-bench")
    p.add_argument(
        "--warm",
        action="store_true",
        help="restore with the image in the page cache (storage_warm.json)",
    )
    p.add_argument(
        "--restores", type=int, default=1, help="restores per checkpoint (median reported)"
    )
    p.add_argument(
        "--name",
        default="",
        help="results file name (default storage, or storage_warm with --warm)",
    )
    a = p.parse_args()
    WARM = a.warm
    RESTORES = max(1, a.restores)
    asyncio.run(main(a.gib, a.kinds, Path(a.dir), a.level, a.name))
