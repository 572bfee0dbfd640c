"""What a lazy restore's staging spends on pagemaps, by the size of a GPU notebook's.

Before CRIU starts, a lazy restore (docs/lazy-restore.md) reads every ``pagemap-*.img``
(:func:`~jupyterhub_gpusnap.checkpoint.pagemap.read_pagemap`) and, with CRIU patch 0015,
writes again those whose lazy runs hold zero-filled blocks, as ``PE_ZERO`` runs
(:func:`~.pagemap.with_zero_pages`, :func:`~.pagemap.pagemap_image`). CRIU's dump writes at
most 1 MiB per pagemap entry, so the kernel of a notebook holding 24 GiB of GPU tensors has
about 27,000 entries (the host copy of the GPU memory), and every one of them is read,
split where zero blocks lie and written, on the restore's path before the kernel answers.

This bench builds such a pagemap (``--entries`` lazy runs of 1 MiB, an eager run of 4
pages after every 100th, ``--zero-mib`` of zero blocks of 64 KiB in 60 clusters, as a GPU
notebook's image has them) and times each step, the median of ``--repeat``:

- ``read``: :func:`~.pagemap.read_pagemap`, and ``read, generic`` the same records through
  :func:`~.protobuf.fields` into runs (how it was read before :func:`~.protobuf.varints`
  decoded messages of one-byte varint tags in one loop);
- ``zero runs``: :func:`~.pagemap.with_zero_pages`;
- ``write``: :func:`~.pagemap.pagemap_image`, and ``write, generic`` as it was written
  before: every record of the image parsed again (to refuse entries without pages, which
  :attr:`~.pagemap.Pagemap.holes` now counts as it reads), then each entry a varint per
  field, each built byte by byte.

Usage: ``python bench/pagemap_staging.py [--entries 27000] [--zero-mib 660] [--repeat 5]
[--name NAME]`` → ``bench/results/pagemap_staging.json``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import print_table, write_json  # noqa: E402

from jupyterhub_gpusnap.checkpoint import protobuf  # noqa: E402
from jupyterhub_gpusnap.checkpoint.page_sums import block_ranges  # noqa: E402
from jupyterhub_gpusnap.checkpoint.pagemap import (  # noqa: E402
    PAGE,
    PE_LAZY,
    PE_PRESENT,
    Run,
    _entry,
    pagemap_image,
    read_pagemap,
    with_zero_pages,
)

BLOCK = 64 << 10


def build(entries: int, zero_mib: int, seed: int = 1) -> tuple[bytes, list[tuple[int, int]]]:
    """A pagemap image like a GPU notebook kernel's, and the zero blocks of its pages file
    (as byte ranges, :func:`~.page_sums.block_ranges`)."""
    rng = random.Random(seed)
    runs, off, va = [], 0, 0x7F0000000000
    for i in range(entries):
        runs.append(Run(va, 256, off, PE_PRESENT | PE_LAZY))
        off, va = off + 256 * PAGE, va + 256 * PAGE
        if i % 100 == 0:
            runs.append(Run(va, 4, off, PE_PRESENT))
            off, va = off + 4 * PAGE, va + 8 * PAGE
    head = protobuf.varint(1 << 3) + protobuf.varint(123)
    image = b"\x00" * 8 + len(head).to_bytes(4, "little") + head
    image += b"".join(len(e).to_bytes(4, "little") + e for e in map(_entry, runs))
    blocks, zero = off // BLOCK, set()
    want = (zero_mib << 20) // BLOCK
    while len(zero) < want:
        start = rng.randrange(max(blocks - 256, 1))
        zero.update(
            range(start, min(start + rng.randrange(want // 90 + 1, want // 30 + 2), blocks))
        )
    return image, block_ranges(sorted(zero)[:want], BLOCK, off)


def _generic_varints(rec: bytes) -> dict[int, int]:
    """A message's varint fields through :func:`.protobuf.fields` (``varints`` before it
    decoded messages of one-byte tags in one loop)."""
    return {k: v for k, v in protobuf.fields(rec) if isinstance(v, int)}


def _generic_varint(n: int) -> bytes:
    """:func:`.protobuf.varint` without its table of one-byte values."""
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def generic_read(image: bytes) -> int:
    """Read as before: every record through :func:`.protobuf.fields`, then a run of each."""
    runs, offset = [], 0
    for rec in protobuf.records(image)[1:]:
        f = _generic_varints(rec)
        nr, flags = f.get(5, f.get(2, 0)), f.get(4, PE_PRESENT)
        if flags & PE_PRESENT:
            runs.append(Run(f.get(1, 0), nr, offset, flags))
            offset += nr * PAGE
    return len(runs)


def generic_write(image: bytes, runs: list[Run]) -> int:
    """Written as before: every record of the image parsed again (entries without pages
    refused), then each entry a varint per field, each built byte by byte."""
    for rec in protobuf.records(image)[1:]:
        if not _generic_varints(rec).get(4, PE_PRESENT) & PE_PRESENT:
            raise ValueError("entries without pages")
    n = 0
    for r in runs:
        fields = ((1, r.vaddr), (2, 0), (4, r.flags), (5, r.nr_pages))
        n += len(b"".join(_generic_varint(k << 3) + _generic_varint(v) for k, v in fields))
    return n


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entries", type=int, default=27000, help="lazy runs of 1 MiB (27,000: 24 GiB)")
    p.add_argument("--zero-mib", type=int, default=660, help="MiB of zero blocks among them")
    p.add_argument("--repeat", type=int, default=5, help="timings per step (median)")
    p.add_argument("--name", default="pagemap_staging", help="results file name")
    a = p.parse_args(argv)
    image, zero = build(a.entries, a.zero_mib)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "pagemap-123.img"
        path.write_bytes(image)
        pm = read_pagemap(path)
        given, zero_bytes = with_zero_pages(pm, zero)
        steps = [
            ("read", lambda: read_pagemap(path)),
            ("read, generic", lambda: generic_read(image)),
            ("zero runs", lambda: with_zero_pages(pm, zero)),
            ("write", lambda: pagemap_image(image, given)),
            ("write, generic", lambda: generic_write(image, given.runs)),
        ]
        rows = [
            {"step": name, "entries": len(pm.runs), "entries_written": len(given.runs),
             "zero_mib": round(zero_bytes / (1 << 20)), "seconds": round(timed(fn, a.repeat), 4)}
            for name, fn in steps
        ]  # fmt: skip
    print_table(rows, ["step", "entries", "entries_written", "zero_mib", "seconds"])
    write_json(a.name, rows, repeat=a.repeat, block=BLOCK)
    return 0


if __name__ == "__main__":
    sys.exit(main())
