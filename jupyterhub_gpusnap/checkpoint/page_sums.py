"""Per-block checksums of a raw ``pages-*.img``, so a lazy restore can check each page it serves.

The manifest keeps one checksum per image file (sha256 over the sha256 of each
``chunk_bytes`` piece, see :mod:`.manifest`): enough to check a whole file, not a page
fetched on its own. A lazy restore of an image kept as files therefore needs a finer
list: the sha256 of every ``BLOCK`` (64 KiB, 16 pages) of each pages file, kept next to
the image as ``.<pages file>.sums`` (a leading dot: not an image file, never handed to
CRIU). A page is served only once its block matches.

:func:`write_sums` reads each pages file once and computes, in the same pass, the block
sums and the file's manifest checksum; it writes the sums only when that checksum is the
one the manifest recorded, so the sums describe the very bytes that were verified (the
file could have changed on the disk since the dump: then no sums, and the restore is
eager). The file ends with the sha256 of everything before it; :func:`load_sums` checks
that, the block size and the pages file's size.

Format: ``b"GSNSUMS1"``, ``u32`` block size, ``u64`` pages file size, one 32-byte sha256
per block (the last one maybe short), then the sha256 of all of that.
"""

from __future__ import annotations

import hashlib
import os
import struct
from concurrent.futures import Executor
from pathlib import Path

BLOCK = 64 << 10
MAGIC = b"GSNSUMS1"
_HEAD = struct.Struct("<8sIQ")
_READ = 4 << 20


class SumsError(ValueError):
    """No usable checksum list (missing, damaged, or for another file)."""


def sums_name(pages_file: str) -> str:
    return f".{pages_file}.sums"


def _hash_piece(path: Path, offset: int, length: int, block: int) -> tuple[bytes, bytes]:
    """(sha256 of the piece, the sha256 of each of its blocks, concatenated)."""
    piece = hashlib.sha256()
    blocks = bytearray()
    fd = os.open(path, os.O_RDONLY)
    try:
        end = offset + length
        while offset < end:
            data = os.pread(fd, min(_READ, end - offset), offset)
            if not data:
                break
            piece.update(data)
            view = memoryview(data)
            for i in range(0, len(view), block):
                blocks += hashlib.sha256(view[i : i + block]).digest()
            offset += len(data)
    finally:
        os.close(fd)
    return piece.digest(), bytes(blocks)


def write_sums(
    folder: Path | str,
    names: list[str],
    pool: Executor,
    *,
    expected: dict[str, str] | None = None,
    chunk_bytes: int = 64 << 20,
    block: int = BLOCK,
) -> list[str]:
    """Write ``.<name>.sums`` for each pages file of ``names``; the problems (empty: all written).

    With ``expected`` (the manifest's ``files``), a file whose checksum (computed as the
    manifest's, with ``chunk_bytes``) differs gets no sums and is named in the problems.
    ``chunk_bytes`` must be a multiple of ``block``, or 0 (the whole file's sha256, as
    manifests written before chunking have it). Blocking: run it in a thread that
    is not one of ``pool``'s.
    """
    folder = Path(folder)
    if chunk_bytes < 0 or chunk_bytes % block:
        raise ValueError(f"chunk_bytes ({chunk_bytes}) must be 0 or a multiple of {block}")
    jobs = {}
    for name in names:
        path = folder / name
        size = path.stat().st_size
        piece = chunk_bytes or max(size, 1)
        jobs[name] = (size, [pool.submit(_hash_piece, path, s, piece, block)
                             for s in range(0, max(size, 1), piece)])  # fmt: skip
    problems = []
    for name, (size, futures) in jobs.items():
        parts = [f.result() for f in futures]
        if chunk_bytes:
            digest = hashlib.sha256(b"".join(p for p, _ in parts)).hexdigest()
        else:
            digest = parts[0][0].hex()
        if expected is not None and expected.get(name) != digest:
            problems.append(
                f"{name}: sha256 {digest[:12]}… differs from the manifest's, no page sums written"
            )
            continue
        body = _HEAD.pack(MAGIC, block, size) + b"".join(b for _, b in parts)
        tmp = folder / f".{sums_name(name)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, body + hashlib.sha256(body).digest())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, folder / sums_name(name))
    return problems


def _zero_blocks(digests: bytes, block: int, size: int) -> frozenset[int]:
    """The indices of the blocks whose digest is that of zero bytes (the last block may be
    short). Found with ``bytes.find``: a restore loads the sums before CRIU starts, and a
    loop over every digest took 0.1 s at 24 GiB."""
    out = set()
    full = hashlib.sha256(bytes(block)).digest()
    i = digests.find(full)
    while i >= 0:
        if i % 32 == 0:
            out.add(i // 32)
        i = digests.find(full, i + 1)
    n = len(digests) // 32
    if n and size % block:  # the last block is short: its digest is that of fewer zeros
        out.discard(n - 1)
        if digests[-32:] == hashlib.sha256(bytes(size % block)).digest():
            out.add(n - 1)
    return frozenset(out)


def block_ranges(blocks, block: int, size: int) -> list[tuple[int, int]]:
    """``blocks`` (block numbers, ``block`` bytes each, of a file of ``size`` bytes) as
    sorted byte ranges ``[(start, end), …]``, neighbouring blocks joined."""
    out: list[tuple[int, int]] = []
    for b in sorted(blocks):
        start, end = b * block, min((b + 1) * block, size)
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        elif start < end:
            out.append((start, end))
    return out


class PageSums:
    """A loaded, self-checked checksum list of one pages file.

    ``zero``: the blocks whose checksum is that of zero bytes, so that their content is
    known without reading them (a GPU process's image holds plenty of zero-filled buffers;
    sha256 leaves no other content with that checksum)."""

    def __init__(self, name: str, block: int, size: int, digests: bytes):
        self.name = name
        self.block = block
        self.size = size
        self.digests = digests
        self.zero = _zero_blocks(digests, block, size)

    def check(self, offset: int, data) -> int | None:
        """The offset of the first block of ``data`` (read from block-aligned ``offset``)
        that does not match, or None."""
        view = memoryview(data)
        for i in range(0, len(view), self.block):
            n = (offset + i) // self.block
            if (
                hashlib.sha256(view[i : i + self.block]).digest()
                != self.digests[32 * n : 32 * n + 32]
            ):
                return offset + i
        return None


def load_sums(folder: Path | str, name: str, size: int) -> PageSums:
    """The checksum list of pages file ``name`` (``size`` bytes); SumsError says why not."""
    path = Path(folder) / sums_name(name)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise SumsError(f"{name}: no page checksums ({path.name} missing)") from None
    if len(raw) < _HEAD.size + 32 or hashlib.sha256(raw[:-32]).digest() != raw[-32:]:
        raise SumsError(f"{name}: {path.name} is damaged")
    magic, block, got = _HEAD.unpack_from(raw)
    n = -(-size // block) if block else -1
    if magic != MAGIC or got != size or len(raw) != _HEAD.size + 32 * n + 32:
        raise SumsError(f"{name}: {path.name} does not describe this {size}-byte file")
    return PageSums(name, block, size, raw[_HEAD.size : -32])
