"""Where each page of a CRIU image lives: the ``pagemap-*.img`` files, read.

CRIU writes a process's memory as ``pages-<N>.img`` (the pages, back to back) plus a
``pagemap-<pid>.img`` that says which addresses they belong to (``images/pagemap.proto``):
a ``pagemap_head {pages_id}`` naming the pages file, then ``pagemap_entry {vaddr,
nr_pages, flags}`` records in address order. Entries flagged ``PE_PRESENT`` have their
pages in the pages file, one after the other in entry order; ``PE_LAZY`` marks pages a
lazy restore (``criu restore --lazy-pages``) leaves out and has the lazy-pages daemon
fetch on demand. Shared memory has its own ``pagemap-shmem-<id>.img``, always restored
eagerly.

An image file is CRIU's two magic numbers (8 bytes), then records, each a little-endian
``u32`` length and a protobuf message (:mod:`.protobuf`). Only what a lazy restore needs
is decoded.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from pathlib import Path

from . import protobuf
from .protobuf import varints

PAGE = 4096
PE_PARENT, PE_LAZY, PE_PRESENT = 1, 2, 4
_TASK = re.compile(r"pagemap-(\d+)\.img")


class PagemapError(ValueError):
    """A pagemap image that cannot be read (damaged or not CRIU's)."""


@dataclass
class Run:
    """Pages ``[vaddr, vaddr + nr_pages * PAGE)`` stored at ``offset`` in their pages file."""

    vaddr: int
    nr_pages: int
    offset: int
    flags: int

    @property
    def lazy(self) -> bool:
        return bool(self.flags & PE_LAZY)

    @property
    def end(self) -> int:
        return self.vaddr + self.nr_pages * PAGE


@dataclass
class Pagemap:
    """One ``pagemap*.img``: its pages file and the runs stored there, in address order."""

    name: str
    pages_id: int
    runs: list[Run] = field(default_factory=list)
    pid: int | None = None  # the process (as the image names it); None for shared memory
    _starts: list[int] = field(default_factory=list, repr=False)

    @property
    def pages_file(self) -> str:
        return f"pages-{self.pages_id}.img"

    def locate(self, vaddr: int, nr_pages: int) -> list[tuple[int, int]]:
        """``[(offset, length), …]`` in the pages file holding ``nr_pages`` pages from
        ``vaddr``; PagemapError when any of them is not in the image."""
        if len(self._starts) != len(self.runs):
            self._starts = [r.vaddr for r in self.runs]
        starts = self._starts
        out: list[tuple[int, int]] = []
        addr, end = vaddr, vaddr + nr_pages * PAGE
        while addr < end:
            i = bisect.bisect_right(starts, addr) - 1
            if i < 0 or addr >= self.runs[i].end:
                raise PagemapError(f"address {addr:#x} of process {self.pid} is not in the image")
            run = self.runs[i]
            n = min(end, run.end) - addr
            off = run.offset + (addr - run.vaddr)
            if out and out[-1][0] + out[-1][1] == off:
                out[-1] = (out[-1][0], out[-1][1] + n)
            else:
                out.append((off, n))
            addr += n
        return out


def read_pagemap(path: Path | str) -> Pagemap:
    """Parse one ``pagemap*.img``."""
    path = Path(path)
    try:
        records = [varints(rec) for rec in protobuf.records(path.read_bytes(), path.name)]
    except protobuf.ProtobufError as e:
        raise PagemapError(f"{path.name}: {e}") from e
    if not records or 1 not in records[0]:
        raise PagemapError(f"{path.name}: no pagemap head")
    m = _TASK.fullmatch(path.name)
    pm = Pagemap(path.name, records[0][1], pid=int(m[1]) if m else None)
    offset = 0
    for rec in records[1:]:
        vaddr = rec.get(1, 0)
        nr = rec.get(5, rec.get(2, 0))
        flags = rec.get(4, PE_PRESENT if not rec.get(3) else PE_PARENT)
        if flags & PE_PARENT:
            raise PagemapError(f"{path.name}: pages in a parent image are not supported")
        if flags & PE_PRESENT:
            pm.runs.append(Run(vaddr, nr, offset, flags))
            offset += nr * PAGE
    return pm


def read_pagemaps(folder: Path | str) -> list[Pagemap]:
    """Every ``pagemap*.img`` of an image folder."""
    return [read_pagemap(p) for p in sorted(Path(folder).glob("pagemap*.img"))]


def eager_ranges(pagemaps: list[Pagemap]) -> dict[str, list[tuple[int, int]]]:
    """{pages file: [(offset, length), …]}: the bytes ``criu restore --lazy-pages`` reads
    itself (everything but the lazy runs of processes), merged and sorted."""
    out: dict[str, list[tuple[int, int]]] = {}
    for pm in pagemaps:
        ranges = out.setdefault(pm.pages_file, [])
        for run in pm.runs:
            if pm.pid is None or not run.lazy:
                ranges.append((run.offset, run.nr_pages * PAGE))
    return {name: merged(ranges) for name, ranges in out.items()}


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[(offset, length), …]`` sorted, overlapping or touching ones joined."""
    out: list[tuple[int, int]] = []
    for off, n in sorted(ranges):
        if out and out[-1][0] + out[-1][1] >= off:
            last = out[-1]
            out[-1] = (last[0], max(last[1], off + n - last[0]))
        else:
            out.append((off, n))
    return out


def lazy_bytes(pagemaps: list[Pagemap]) -> int:
    """Bytes a lazy restore leaves to the page server."""
    return sum(
        r.nr_pages * PAGE for pm in pagemaps if pm.pid is not None for r in pm.runs if r.lazy
    )
