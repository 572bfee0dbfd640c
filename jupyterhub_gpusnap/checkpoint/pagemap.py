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
#: not in CRIU's images: pages known to hold zeros, for CRIU patch 0015 (:func:`with_zero_pages`)
PE_ZERO = 8
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
    #: where the pages are in the image's pages file (-1: at ``offset``; differs in a
    #: pagemap given to CRIU with some of the image's pages as zero pages, :func:`with_zero_pages`)
    source: int = -1

    @property
    def stored_at(self) -> int:
        return self.offset if self.source < 0 else self.source

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
    holes: int = 0  # entries that store no pages (not in ``runs``)
    _starts: list[int] = field(default_factory=list, repr=False)

    @property
    def pages_file(self) -> str:
        return f"pages-{self.pages_id}.img"

    def locate(self, vaddr: int, nr_pages: int) -> list[tuple[int, int]]:
        """``[(offset, length), …]`` in the image's pages file holding ``nr_pages`` pages
        from ``vaddr``; PagemapError when any of them is not in the image."""
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
            off = run.stored_at + (addr - run.vaddr)
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
        else:
            pm.holes += 1
    return pm


def read_pagemaps(folder: Path | str) -> list[Pagemap]:
    """Every ``pagemap*.img`` of an image folder."""
    return [read_pagemap(p) for p in sorted(Path(folder).glob("pagemap*.img"))]


def eager_ranges(pagemaps: list[Pagemap]) -> dict[str, list[tuple[int, int]]]:
    """{pages file: [(offset, length), …]}: the bytes ``criu restore --lazy-pages`` reads
    itself (everything but the lazy runs of processes), merged and sorted."""
    return {
        name: merged([(src, n) for src, _, n in copies])
        for name, copies in eager_copies(pagemaps).items()
    }


def eager_copies(pagemaps: list[Pagemap]) -> dict[str, list[tuple[int, int, int]]]:
    """{pages file: [(offset in the image's file, offset in the one CRIU reads, length), …]}:
    what :func:`eager_ranges` names, for pagemaps given to CRIU (:func:`with_zero_pages`),
    sorted, runs that follow each other in both files joined."""
    out: dict[str, list[tuple[int, int, int]]] = {}
    for pm in pagemaps:
        copies = out.setdefault(pm.pages_file, [])
        for run in pm.runs:
            if pm.pid is None or not run.lazy:
                copies.append((run.stored_at, run.offset, run.nr_pages * PAGE))
    for name, copies in out.items():
        joined: list[tuple[int, int, int]] = []
        for src, dst, n in sorted(copies, key=lambda c: c[1]):
            if (
                joined
                and joined[-1][0] + joined[-1][2] == src
                and joined[-1][1] + joined[-1][2] == dst
            ):
                joined[-1] = (joined[-1][0], joined[-1][1], joined[-1][2] + n)
            else:
                joined.append((src, dst, n))
        out[name] = joined
    return out


def with_zero_pages(pm: Pagemap, zero: list[tuple[int, int]]) -> tuple[Pagemap, int]:
    """``pm`` as a lazy restore gives it to CRIU: the pages of its lazy runs that lie in
    ``zero``, sorted byte ranges ``[(start, end), …]`` of its pages file known to hold zero
    bytes (their page sums or chunk ids say so: :meth:`.page_source.RawPages.zero_ranges`),
    become runs flagged ``PE_ZERO``, not stored (each run's ``offset`` is that in a pages
    file without them, its ``source`` that in the image's); and how many bytes that is. Only
    whole pages count. ``pm`` itself when none are (a pagemap of shared memory, always
    restored eagerly, included).

    CRIU's daemon with patch 0015 maps the zero page over ``PE_ZERO`` runs when it takes
    the process over, and never asks for them: zero-filled memory is neither read, sent nor
    copied, and reading it faults nowhere (the GPU driver's restore reads the host copy of
    the device memory, zero-filled parts included). Lazy memory is private anonymous
    memory only, where the zero page is what an untouched page reads anyway; a write
    copies it, as the kernel does for any such page."""
    if pm.pid is None or not zero:
        return pm, 0
    starts = [start for start, _ in zero]
    out = Pagemap(pm.name, pm.pages_id, pid=pm.pid, holes=pm.holes)
    at = zeros = 0

    def add(run: Run, start: int, end: int, flags: int) -> None:  # [start, end) of the image's file
        nonlocal at
        if end <= start:
            return
        vaddr, nr = run.vaddr + (start - run.offset), (end - start) // PAGE
        last = out.runs[-1] if out.runs else None
        if flags & PE_ZERO and last is not None and last.flags == flags and last.end == vaddr:
            last.nr_pages += nr
            return
        out.runs.append(Run(vaddr, nr, at, flags, source=start))
        if not flags & PE_ZERO:
            at += end - start

    for run in pm.runs:
        start, end = run.offset, run.offset + run.nr_pages * PAGE
        i = max(bisect.bisect_right(starts, start) - 1, 0)  # the first range that may reach in
        pos = start
        while run.lazy and i < len(zero) and zero[i][0] < end:
            lo = max(-(-zero[i][0] // PAGE) * PAGE, pos)  # whole pages only
            hi = min(zero[i][1] // PAGE * PAGE, end)
            if lo < hi:
                add(run, pos, lo, run.flags)
                add(run, lo, hi, PE_LAZY | PE_ZERO)
                zeros += hi - lo
                pos = hi
            i += 1
        add(run, pos, end, run.flags)
    return (out, zeros) if zeros else (pm, 0)


def pagemap_image(original: bytes, pm: Pagemap) -> bytes:
    """The bytes of a ``pagemap-*.img`` holding ``pm``, with ``original``'s (that of the
    image ``pm`` was made from) magic numbers and head. PagemapError when that image has
    entries other than the pages it stores (``pm.holes``: those are not written again)."""
    if pm.holes:
        raise PagemapError(f"{pm.name}: has entries without pages")
    try:
        head = protobuf.records(original, pm.name)[0]
    except (protobuf.ProtobufError, IndexError) as e:
        raise PagemapError(f"{pm.name}: no pagemap head ({e})") from e
    out = bytearray(original[:8])
    for rec in [head, *map(_entry, pm.runs)]:
        out += len(rec).to_bytes(4, "little") + rec
    return bytes(out)


def _entry(run: Run) -> bytes:
    """A ``pagemap_entry`` as CRIU writes it (``vaddr``, its old 32-bit page count left 0,
    ``flags``, the page count in ``nr_pages``)."""
    varint = protobuf.varint
    return (
        b"\x08"
        + varint(run.vaddr)
        + b"\x10\x00\x20"
        + varint(run.flags)
        + b"\x28"
        + varint(run.nr_pages)
    )


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
    """Bytes a lazy restore leaves to the page server (zero pages are not asked for)."""
    return sum(
        r.nr_pages * PAGE
        for pm in pagemaps
        if pm.pid is not None
        for r in pm.runs
        if r.lazy and not r.flags & PE_ZERO
    )
