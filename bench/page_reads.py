"""How fast the lazy restore's page source reads a pages file, against the disk's own rate.

A lazy restore from files (docs/lazy-restore.md) reads each pages file through
:class:`~jupyterhub_gpusnap.checkpoint.page_source.RawPages`: segments of 1 MiB, each
checked against its page sums (sha256 per 64 KiB) on the hash pool, read ahead of the
background transfer (``page_server.AHEAD``). This bench writes a pages file of random
bytes (and its sums), drops it from the page cache, and reads it through in 4 MiB
requests in file order, as the background transfer asks:

- ``sequential``: one reader, 8 MiB ``pread`` calls, nothing checked: the disk's rate
  for CRIU's eager read, the limit;
- ``page source``: ``RawPages`` with the page server's read-ahead, what a lazy restore does;
- ``page source, no read-ahead``: the same, each request read when it comes;
- ``page source, cached``: the file in the page cache, so only the checks and copies count.

``GB_per_s`` is the median of ``--restores`` reads; ``vs_sequential`` divides it by the
``sequential`` row's. ``--threads`` sets the hash pool's threads (``LocalBackend.hash_threads``;
default: one per core, as the backend's), one set of page source rows per number. Dropping the file from the page cache uses ``posix_fadvise``
(``DONTNEED``), no root needed.

Usage: ``python bench/page_reads.py [--mib 2048] [--restores 3] [--threads N ...] [--dir DIR]
[--name NAME]``
→ ``bench/results/page_reads.json``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_table, write_json  # noqa: E402

from jupyterhub_gpusnap.checkpoint.manifest import drop_file_cached  # noqa: E402
from jupyterhub_gpusnap.checkpoint.page_server import AHEAD  # noqa: E402
from jupyterhub_gpusnap.checkpoint.page_source import RawPages  # noqa: E402
from jupyterhub_gpusnap.checkpoint.page_sums import load_sums, write_sums  # noqa: E402

REQUEST = 4 << 20  # the background transfer's largest request
SEQUENTIAL = 8 << 20
NAME = "pages-1.img"


def make_pages(folder: Path, size: int, pool) -> Path:
    """A pages file of ``size`` random bytes and its page sums, on the disk."""
    path = folder / NAME
    rng = random.Random(0)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 64 << 20)
            f.write(rng.randbytes(n))
            left -= n
        f.flush()
        os.fsync(f.fileno())
    problems = write_sums(folder, [NAME], pool)
    if problems:
        raise SystemExit(f"page sums not written: {problems}")
    return path


def read_sequential(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    got = 0
    try:
        while True:
            data = os.pread(fd, SEQUENTIAL, got)
            if not data:
                return got
            got += len(data)
    finally:
        os.close(fd)


def read_source(path: Path, pool, ahead: int) -> int:
    """Through ``path`` in 4 MiB requests, as the page server answers the background
    transfer: read ahead of each request (when ``ahead``), then the request's checked bytes."""
    sums = load_sums(path.parent, path.name, path.stat().st_size)
    source = RawPages(path, sums, pool)
    got = 0
    try:
        while got < source.size:
            n = min(REQUEST, source.size - got)
            if ahead:
                source.ahead(got + n, ahead)
            got += sum(len(v) for v in source.read(got, n))
        return got
    finally:
        source.close()


SOURCE_PATTERNS = [
    ("page source", AHEAD, True),
    ("page source, no read-ahead", 0, True),
    ("page source, cached", AHEAD, False),
]


def measure(path: Path, restores: int, pools: dict[int, ThreadPoolExecutor]) -> list[dict]:
    """Rows: ``sequential``, then the page source patterns with each pool ({threads: pool})."""
    size = path.stat().st_size
    runs = [("sequential", None, lambda: read_sequential(path), True)]
    for threads, pool in pools.items():
        for name, ahead, cold in SOURCE_PATTERNS:
            runs.append(
                (name, threads, lambda pool=pool, ahead=ahead: read_source(path, pool, ahead), cold)
            )
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(restores):
        for i, (name, _, read, cold) in enumerate(runs):  # alternating: a slow spell hits all
            if cold:
                drop_file_cached(path)
            else:
                read_sequential(path)  # into the page cache
            t = time.perf_counter()
            got = read()
            times[i].append(time.perf_counter() - t)
            if got != size:
                raise SystemExit(f"{name}: read {got} bytes of {size}")
    rows = []
    for (name, threads, _, cold), ts in zip(runs, times, strict=True):
        s = statistics.median(ts)
        rows.append({"pattern": name, "threads": threads, "cold": cold, "mib": size >> 20,
                     "seconds": round(s, 3), "GB_per_s": round(size / s / 1e9, 2),
                     "runs_s": [round(t, 3) for t in ts]})  # fmt: skip
    base = rows[0]["GB_per_s"]
    for r in rows:
        r["vs_sequential"] = round(r["GB_per_s"] / base, 2)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=2048, help="size of the pages file")
    p.add_argument("--restores", type=int, default=3, help="reads of each pattern")
    p.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count() or 1],
                   help="hash pool threads to try (default: one per core)")  # fmt: skip
    p.add_argument("--dir", default="", help="where the file goes (default: a temporary folder)")
    p.add_argument("--name", default="page_reads")
    a = p.parse_args(argv)
    if a.mib < 1 or a.restores < 1 or min(a.threads) < 1:
        p.error("--mib, --restores and --threads must be at least 1")
    pools = {n: ThreadPoolExecutor(n, thread_name_prefix="gpusnap-hash") for n in a.threads}
    try:
        with tempfile.TemporaryDirectory(dir=a.dir or None, prefix="page-reads-") as tmp:
            path = make_pages(Path(tmp), a.mib << 20, pools[a.threads[0]])
            rows = measure(path, a.restores, pools)
    finally:
        for pool in pools.values():
            pool.shutdown()
    print_table(rows, ["pattern", "threads", "cold", "mib", "seconds", "GB_per_s", "vs_sequential"])
    write_json(a.name, rows, dir=a.dir or tempfile.gettempdir(), ahead=AHEAD, request=REQUEST)
    return rows


if __name__ == "__main__":
    main()
