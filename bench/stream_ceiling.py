"""How fast can CRIU take a streamed image at all? A streamed chunk restore against its ceiling.

bench/storage.py times whole restores; this one separates CRIU's own limit from the
streamer's. A detached process holds GIB GiB (bench/mem_holder.py), is dumped once with
plain ``criu dump`` into a memory file system (/dev/shm) and its image is also packed
into a ``ChunkStore`` (kept in the page cache). Then, REPEAT times in turn, with no disk
involved:

- ``files``: ``criu restore`` from the image files (CRIU's file mode: preadv into place);
- ``stream, files``: ``criu restore --stream`` fed by splicing the same files into each
  pipe (page references, no copy, no checks) — the most any streamer can give CRIU;
- ``stream, chunks``: ``criu restore --stream`` fed by ``ChunkStreamer`` (every chunk read,
  checked and decompressed while CRIU runs) — what ``LocalBackend`` does. ``waited_*``:
  seconds its senders waited for the next chunk (``storage``) and for room in the pipe
  (``criu``).

Each restored process is checked (sha256 of its data, first round) and killed. Ratios are
to the ``files`` median. The pipe is ``LocalBackend.restore_pipe_bytes`` (16 MiB) where
``/proc/sys/fs/pipe-max-size`` allows; the JSON records that limit.

Usage: ``python bench/stream_ceiling.py [--gib 4] [--kind weights|random] [--repeat 3]``
→ bench/results/stream_ceiling.json (``stream_ceiling_random.json`` for random data). Needs
root and CRIU >= 4.2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import print_table, write_json
from storage import Holder, pipe_max_size, wait_gone

from jupyterhub_gpusnap.checkpoint import streamer as S
from jupyterhub_gpusnap.checkpoint.chunks import ChunkStore
from jupyterhub_gpusnap.checkpoint.criu import find_criu


class SpliceFeeder(S.ChunkStreamer):
    """ChunkStreamer's side of the protocol, answered from raw image files by splice(2):
    page references into the pipe, no copy, no checks."""

    def __init__(self, images: Path, folder: Path):
        super().__init__(None, "", {p.name: [] for p in images.iterdir() if p.is_file()}, folder)
        self.images = images

    def _send(self, name: str, fd: int) -> None:
        got = S.grow_pipe(fd, self.pipe_bytes)
        with self._lock:
            self.pipe_got = max(self.pipe_got, got)
        src = os.open(self.images / name, os.O_RDONLY)
        try:
            while os.splice(src, fd, 1 << 30):
                pass
        except BrokenPipeError:
            pass
        finally:
            os.close(src)
            os.close(fd)


def main(gib: float, kind: str, repeat: int, root: Path) -> None:
    criu = find_criu()
    if not criu:
        sys.exit("criu not found: install it with .ci/install-criu.sh")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    images = Path("/dev/shm/gpusnap-stream-ceiling")
    shutil.rmtree(images, ignore_errors=True)
    images.mkdir(mode=0o700)
    stream_dir = root / "stream"
    stream_dir.mkdir()
    threads = os.cpu_count() or 1
    pool = ThreadPoolExecutor(threads)
    try:
        h = Holder(kind, gib, 1, root)
        before = h.checksum()
        subprocess.run(
            [criu, "dump", "-t", str(h.pid), "-D", str(images), "-o", "dump.log"], check=True
        )
        h.proc.wait()
        store = ChunkStore(root / "store", pool)
        files = sorted(p for p in images.iterdir() if p.name.endswith(".img"))
        chunks = {n: p.chunks for n, p in store.pack(files).items()}
        image_bytes = sum(p.stat().st_size for p in files)
        print(
            f"{kind}: {gib:g} GiB dumped ({image_bytes} bytes in {len(files)} files) and packed",
            flush=True,
        )
        rows = []

        def restore(mode: str, check: bool) -> dict:
            pidfile = root / "restore.pid"
            pidfile.unlink(missing_ok=True)
            args = [criu, "restore", "-d", "--pidfile", str(pidfile), "-o", "restore.log"]
            feeder = None
            if mode == "files":
                args += ["-D", str(images)]
            else:
                args += ["-D", str(stream_dir), "--stream"]
                if mode == "stream, files":
                    feeder = SpliceFeeder(images, stream_dir).start()
                else:
                    feeder = S.ChunkStreamer(store, "plain", chunks, stream_dir, window=4 * threads,
                                             prefetch=16 * threads).start()  # fmt: skip
            t = time.perf_counter()
            done = subprocess.run(args)
            seconds = time.perf_counter() - t
            problems = feeder.finish() if feeder else []
            if done.returncode or problems:
                log = (images if mode == "files" else stream_dir) / "restore.log"
                sys.exit(f"{mode}: restore failed {problems}: {log.read_text()[-2000:]}")
            pid = int(pidfile.read_text())
            intact = None
            if check:
                h.pid, h.n = pid, 1  # its count of answers as it was dumped
                intact = h.checksum() == before
            os.kill(pid, signal.SIGKILL)
            wait_gone(pid)
            waited = feeder.waited if mode == "stream, chunks" else None
            row = {
                "mode": mode, "seconds": round(seconds, 3), "GBps": round(image_bytes / seconds / 1e9, 2),
                "pipe_kib": (getattr(feeder, "pipe_got", 0) >> 10) or None,
                "waited_storage_s": round(waited["storage_s"], 3) if waited else None,
                "waited_criu_s": round(waited["criu_s"], 3) if waited else None,
                "intact": intact,
            }  # fmt: skip
            print(row, flush=True)
            return row

        for i in range(repeat):
            for mode in ("files", "stream, files", "stream, chunks"):
                rows.append(dict(restore(mode, check=i == 0), round=i + 1))
        base = statistics.median(r["seconds"] for r in rows if r["mode"] == "files")
        summary = []
        for mode in ("files", "stream, files", "stream, chunks"):
            mine = [r for r in rows if r["mode"] == mode]
            med = statistics.median(r["seconds"] for r in mine)
            summary.append({"mode": mode, "kind": kind, "gib": gib, "runs": len(mine),
                            "median_s": round(med, 3), "min_s": min(r["seconds"] for r in mine),
                            "max_s": max(r["seconds"] for r in mine), "ratio": round(med / base, 3),
                            "intact": all(r["intact"] is not False for r in mine)})  # fmt: skip
        print()
        print_table(
            rows,
            [
                "round",
                "mode",
                "seconds",
                "GBps",
                "pipe_kib",
                "waited_storage_s",
                "waited_criu_s",
                "intact",
            ],
        )
        print()
        table = print_table(
            summary,
            ["kind", "gib", "mode", "runs", "median_s", "min_s", "max_s", "ratio", "intact"],
        )
        name = "stream_ceiling" if kind == "weights" else f"stream_ceiling_{kind}"
        write_json(name, rows, summary=summary, table=table, image_bytes=image_bytes,
                   threads=threads, pipe_max_size=pipe_max_size(), data=h.how)  # fmt: skip
    finally:
        pool.shutdown()
        shutil.rmtree(images, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=4)
    p.add_argument("--kind", choices=["weights", "random"], default="weights")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default="/var/tmp/gpusnap-stream-ceiling")
    a = p.parse_args()
    main(a.gib, a.kind, a.repeat, Path(a.dir))
