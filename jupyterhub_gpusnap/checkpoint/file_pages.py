"""The library pages a restore will read, read ahead all at once.

A process writes into its private file mappings (a library's data and relocations, a
Python extension's tables); CRIU dumps those pages and, at restore, writes them back into
a private mapping of the same file. Each such write first reads the file's page (copy on
write), one fault at a time, and with a cold page cache each is a random read of the
library: 0.3 s of a 1 GiB GPU kernel's restore on an H100 host, before any of it runs
(docs/lazy-restore.md). :func:`written_file_ranges` finds where those pages lie in their
files, from the image: ``mm-<pid>.img`` (each memory area, its file and offset),
``files.img`` (the files' names) and the pagemaps (which pages were dumped);
:func:`read_ahead` asks the kernel to read all of them at once (``POSIX_FADV_WILLNEED``),
so that they are in the page cache when CRIU writes the pages back.

Only the bytes CRIU will read are asked for, and only from regular files that exist here
under the name the image gives (a server restored on the machine it ran on sees the same
files); anything else is skipped. Reading ahead never changes what is restored.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from .pagemap import PAGE, Pagemap, PagemapError, merged, read_pagemaps
from .protobuf import fields, records

VMA_FILE_PRIVATE = 1 << 6  # CRIU's vma status (criu/include/image.h)
FD_TYPE_REG = 1  # fdinfo.proto fd_types REG


@dataclass(frozen=True)
class Area:
    """A private file mapping of a process: ``[start, end)`` maps file ``file_id`` from
    byte ``pgoff``."""

    start: int
    end: int
    pgoff: int
    file_id: int


def is_map_file(name: str) -> bool:
    """Whether ``name`` is one of the image files :func:`written_file_ranges` reads."""
    return name == "files.img" or name.startswith(("mm-", "pagemap"))


def read_files(folder: Path) -> dict[int, str]:
    """{file id: name} of the regular files in ``files.img``."""
    names = {}
    for rec in records((folder / "files.img").read_bytes(), "files.img"):
        entry = dict(fields(rec))
        if entry.get(1) == FD_TYPE_REG and isinstance(entry.get(3), bytes):
            reg = dict(fields(entry[3]))
            name = reg.get(6)
            if isinstance(name, bytes):
                names[entry[2]] = name.decode("utf-8", "surrogateescape")
    return names


def read_areas(path: Path) -> list[Area]:
    """The private file mappings of one ``mm-<pid>.img``, in address order."""
    areas = []
    for rec in records(path.read_bytes(), path.name)[:1]:
        for number, value in fields(rec):
            if number != 14 or not isinstance(value, bytes):  # mm_entry.vmas
                continue
            vma = dict(fields(value))
            if vma.get(7, 0) & VMA_FILE_PRIVATE:
                areas.append(Area(vma[1], vma[2], vma[3], vma[4]))
    return sorted(areas, key=lambda a: a.start)


def written_file_ranges(
    folder: Path | str, pagemaps: list[Pagemap]
) -> dict[str, list[tuple[int, int]]]:
    """{file name: [(offset, length), …]}: where in their files lie the pages the image
    holds of its processes' private file mappings (merged, sorted). Images it cannot read
    give nothing."""
    folder = Path(folder)
    try:
        names = read_files(folder)
    except (OSError, ValueError, KeyError):
        return {}
    out: dict[str, list[tuple[int, int]]] = {}
    for pm in pagemaps:
        if pm.pid is None:
            continue
        try:
            areas = read_areas(folder / f"mm-{pm.pid}.img")
        except (OSError, ValueError, KeyError):
            continue
        i = 0
        for run in pm.runs:  # both in address order
            addr, end = run.vaddr, run.end
            while i < len(areas) and areas[i].end <= addr:
                i += 1
            j = i
            while j < len(areas) and areas[j].start < end:
                a = areas[j]
                lo, hi = max(addr, a.start), min(end, a.end)
                name = names.get(a.file_id)
                if name is not None and lo < hi:
                    out.setdefault(name, []).append((a.pgoff + lo - a.start, hi - lo))
                j += 1
    return {name: merged(ranges) for name, ranges in out.items()}


def read_ahead(ranges: dict[str, list[tuple[int, int]]]) -> int:
    """Ask the kernel to read ``ranges`` into the page cache now (it reads them in the
    background); the bytes asked for. Files that are missing or not regular are skipped."""
    asked = 0
    for name, spans in ranges.items():
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            for off, n in spans:
                os.posix_fadvise(fd, off - off % PAGE, n + off % PAGE, os.POSIX_FADV_WILLNEED)
                asked += n
        except OSError:
            continue
        finally:
            os.close(fd)
    return asked


def read_ahead_image(folder: Path | str, pagemaps: list[Pagemap] | None = None) -> int:
    """:func:`read_ahead` the file pages of the image in ``folder`` (``pagemaps``: its
    pagemaps, read here when not given); the bytes asked for, 0 when the image cannot be read."""
    try:
        if pagemaps is None:
            pagemaps = read_pagemaps(folder)
        return read_ahead(written_file_ranges(folder, pagemaps))
    except (OSError, PagemapError):
        return 0
