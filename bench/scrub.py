"""What protecting shared chunks costs: verification on write, replicas, the scrub.

A file of GIB GiB (bf16 weights as in bench/mem_holder.py, or random bytes) is packed into
a ``ChunkStore`` as a checkpoint's ``pages-1.img`` is (compressed, fsync'ed, durable), with
the page cache dropped before the rows marked ``cold`` (root only):

- ``new``: into an empty store, one copy per chunk — the baseline of the write rows;
- ``new, every chunk twice``: the same with a replica of every chunk written alongside
  (``LocalBackend.replicate_min_servers = 1``);
- ``again, trusted``: the same file packed once more (a server suspended again, the same
  model in another server): every chunk is found stored, and trusted
  (``verify_dedup = False``) — the baseline of the ``again`` rows;
- ``again, verified``: the same, each stored chunk read back and checked first
  (``verify_dedup = True``, the default), from the page cache and (``cold``) from the disk;
- ``scrub``: a full :func:`jupyterhub_gpusnap.checkpoint.scrub.scrub` of the store, cold,
  with no limit, without and with replicas, and at ``--rate-mib`` MiB/s
  (``LocalBackend.scrub_bytes_per_second``): ``gib_per_s`` is what it read per second.

``written_mib``: what reached the store; ``read_mib``: stored chunks read back; ``ratio``:
seconds against the row's baseline (``new`` or ``again, trusted`` of the same cache state).

Usage: ``python bench/scrub.py [--gib 1] [--kind weights|random] [--dir DIR]
[--rate-mib 256] [--name scrub]`` → bench/results/<name>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import print_table, write_json
from mem_holder import seeded_bytes, weights

from jupyterhub_gpusnap.checkpoint import scrub as chunk_scrub
from jupyterhub_gpusnap.checkpoint.chunks import PAGE, ChunkStore
from jupyterhub_gpusnap.checkpoint.manifest import Manifest

NAME = "pages-1.img"
COLUMNS = ["row", "cold", "seconds", "gib_per_s", "written_mib", "read_mib", "ratio", "intact"]
MiB = 1 << 20


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def store_in(root: Path, pool, **kw) -> ChunkStore:
    return ChunkStore(root / ".chunks", pool, level=1, avg_pages=(2 * MiB) // PAGE, **kw)


def pack_row(row: str, store: ChunkStore, image: Path, cold: bool) -> tuple[dict, list]:
    got_cold = drop_caches() if cold else False
    t = time.monotonic()
    packed = store.pack([image])[NAME]
    seconds = time.monotonic() - t
    return {
        "row": row,
        "cold": got_cold,
        "seconds": round(seconds, 3),
        "gib_per_s": round(packed.size / seconds / 2**30, 3),
        "written_mib": round(packed.new_bytes / MiB, 1),
        "read_mib": round(packed.stored_bytes / MiB, 1)
        if store.verify_dedup and not packed.new_bytes
        else 0.0,
    }, packed.chunks


async def scrub_row(row: str, store: ChunkStore, found, min_servers: int, rate: int) -> dict:
    got_cold = drop_caches()
    t = time.monotonic()
    report = await chunk_scrub.scrub(
        store, found, full=True, min_servers=min_servers, bytes_per_second=rate,
        log=logging.getLogger("bench"),
    )  # fmt: skip
    seconds = time.monotonic() - t
    return {
        "row": row,
        "cold": got_cold,
        "seconds": round(seconds, 3),
        "gib_per_s": round(report.bytes_read / seconds / 2**30, 3),
        "written_mib": 0.0,
        "read_mib": round(report.bytes_read / MiB, 1),
        "intact": report.ok == report.chunks and not report.damaged,
    }


def checkpoint_record(root: Path, chunks: list) -> list:
    """One verified checkpoint listing ``chunks``, as the scrub reads them from manifests."""
    folder = root / "bench" / "_default" / "1"
    folder.mkdir(parents=True, exist_ok=True)
    m = Manifest(user="bench", server="", created=time.time(), status="verified",
                 storage="chunks", key_id="plain", chunks={NAME: chunks}, verified_at=time.time())  # fmt: skip
    m.save(folder)
    return [("bench/_default/1", folder, m, False)]


async def run(args) -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix="bench-scrub-", dir=args.dir))
    pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="bench")
    try:
        n = int(args.gib * 2**30)
        data = weights(n, 1)[0] if args.kind == "weights" else seeded_bytes(n, 1)
        image = work / NAME
        image.write_bytes(data)
        del data
        rows = []
        one, two = work / "one", work / "two"
        new, chunks = pack_row("new", store_in(one, pool), image, cold=True)
        rows.append(dict(new, ratio=1.0))
        twice, _ = pack_row("new, every chunk twice",
                            store_in(two, pool, replica_root=two / ".replica", replicate_all=True),
                            image, cold=True)  # fmt: skip
        rows.append(dict(twice, ratio=round(twice["seconds"] / new["seconds"], 3)))
        for cold in (False, True):
            base, _ = pack_row(
                "again, trusted", store_in(one, pool, verify_dedup=False), image, cold
            )
            rows.append(dict(base, ratio=1.0))
            checked, _ = pack_row("again, verified", store_in(one, pool), image, cold)
            rows.append(dict(checked, ratio=round(checked["seconds"] / base["seconds"], 3)))
        found = checkpoint_record(one, chunks)
        rows.append(await scrub_row("scrub", store_in(one, pool), found, 2, 0))
        found2 = checkpoint_record(two, chunks)
        rows.append(await scrub_row("scrub, every chunk twice",
                                    store_in(two, pool, replica_root=two / ".replica"), found2, 1, 0))  # fmt: skip
        rows.append(await scrub_row(f"scrub at {args.rate_mib} MiB/s", store_in(one, pool), found, 2,
                                    args.rate_mib * MiB))  # fmt: skip
        return rows
    finally:
        pool.shutdown()
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--kind", choices=["weights", "random"], default="weights")
    p.add_argument("--dir", default=None, help="where the store goes (default: the temp folder)")
    p.add_argument("--rate-mib", type=int, default=256)
    p.add_argument("--name", default="scrub")
    args = p.parse_args()
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    rows = asyncio.run(run(args))
    print_table(rows, COLUMNS)
    write_json(args.name, rows, gib=args.gib, kind=args.kind, rate_mib=args.rate_mib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
