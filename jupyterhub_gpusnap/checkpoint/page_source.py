"""Checked reads of a pages file, by offset: what the page server hands out.

Two sources, one interface (:meth:`read` blocks, for a thread pool; :meth:`ahead`
starts checking what comes next in the pool):

:class:`RawPages`
    A ``pages-*.img`` kept as a file, checked against its :mod:`.page_sums` list in
    segments of 1 MiB (16 blocks of 64 KiB): a fault costs one segment's read and hash.
    A block whose checksum is that of zero bytes is not read: its content is known (a GPU
    process's image holds plenty of zero-filled buffers, which an eager restore reads).
:class:`ChunkPages`
    A pages file kept in the chunk store: each chunk is read, opened, decompressed and
    checked against its id (:meth:`.ChunkStore.get`, which also repairs it from a
    replica) straight from the store, no unpacked copy. A chunk whose id is that of zero
    bytes (:meth:`.ChunkStore.zero_id`) is not read either.

Both say which bytes of the file they know to be zeros without reading them
(:meth:`zero_ranges`): a lazy restore maps zero pages there instead of asking for them.

Checked segments (or chunks) stay in memory, the last ``keep`` bytes of them: a fault and
the background transfer that follows often land in the same one, and :meth:`ahead` fills
the cache before the lazy-pages daemon asks (it fetches in address order, which is file
order). Kept by bytes, not by count: a chunk holds 512 KiB to 8 MiB, and what
:meth:`ahead` checked must still be there when it is asked for. Either raises
:class:`PageDamaged`, naming the file, the offset and the block or chunk, when bytes do
not match: they are never returned.
"""

from __future__ import annotations

import bisect
import os
import threading
from collections import Counter, OrderedDict
from concurrent.futures import Executor
from pathlib import Path

from .chunks import ChunkStore
from .page_sums import PageSums, block_ranges

SEGMENT = 1 << 20
KEEP = 128 << 20  # checked bytes kept per pages file: more than the page server reads ahead
ZERO_CANDIDATES = 8  # the repeated chunks of a pages file, most bytes first, tried as zeros


class PageDamaged(ValueError):
    """Bytes of a pages file that fail their check (or cannot be read)."""


class _Segmented:
    """A file in checked segments: ``starts`` (offsets), ``size``, ``_load(i)``;
    ``zero_bytes``, what was served without reading it; ``loaded_bytes``, the segments
    loaded so far (read and checked, zero blocks included)."""

    name: str
    size: int
    starts: list[int]
    zero_bytes = 0  # bytes served as zeros without reading them (their checksum or id says so)
    loaded_bytes = 0

    def __init__(self, pool: Executor, keep: int):
        self.pool = pool
        self.keep = keep
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._cached = 0  # bytes in _cache
        self._loading: dict[int, threading.Event] = {}
        self._lock = threading.Lock()

    def _load(self, i: int) -> bytes:
        raise NotImplementedError

    def _hint(self, i: int) -> None:
        """Start the disk read of segment ``i`` (it will be loaded soon)."""

    def zero_ranges(self) -> list[tuple[int, int]]:
        """The byte ranges ``[(start, end), …]`` (sorted) known to hold zeros without
        reading them; none here."""
        return []

    def _segment(self, i: int) -> bytes:
        """Segment ``i``'s checked bytes (checked once, kept among the last ``keep``)."""
        while True:
            with self._lock:
                data = self._cache.get(i)
                if data is not None:
                    self._cache.move_to_end(i)
                    return data
                busy = self._loading.get(i)
                if busy is None:
                    self._loading[i] = threading.Event()
                    break
            busy.wait()
        try:
            data = self._load(i)
        except BaseException:
            with self._lock:
                self._loading.pop(i).set()
            raise
        with self._lock:  # cached before the waiters wake: none of them loads it again
            self._cache[i] = data
            self._cached += len(data)
            self.loaded_bytes += len(data)
            while self._cached > self.keep and len(self._cache) > 1:
                self._cached -= len(self._cache.popitem(last=False)[1])
            self._loading.pop(i).set()
        return data

    def read(self, offset: int, length: int) -> list[memoryview]:
        """``length`` checked bytes from ``offset``, as views of checked segments (no copy;
        PageDamaged if any fail their check)."""
        if offset < 0 or offset + length > self.size:
            raise PageDamaged(
                f"{self.name}: bytes {offset}-{offset + length} beyond its {self.size}"
            )
        out = []
        i = bisect.bisect_right(self.starts, offset) - 1
        pos, end = offset, offset + length
        while pos < end:
            data = memoryview(self._segment(i))
            s = pos - self.starts[i]
            piece = data[s : s + (end - pos)]
            out.append(piece)
            pos += len(piece)
            i += 1
        return out

    def prefix(self, offset: int, length: int) -> tuple[list[memoryview], int]:
        """The checked bytes from ``offset`` that are in memory already, up to ``length``
        and up to the first segment that is not (views, their total length; no waiting)."""
        out: list[memoryview] = []
        if offset < 0 or offset + length > self.size:
            return out, 0
        i = bisect.bisect_right(self.starts, offset) - 1
        pos, end = offset, offset + length
        with self._lock:
            while pos < end:
                data = self._cache.get(i)
                if data is None:
                    break
                s = pos - self.starts[i]
                piece = memoryview(data)[s : s + (end - pos)]
                out.append(piece)
                pos += len(piece)
                i += 1
        return out, pos - offset

    def read_once(self, offset: int, length: int) -> bytes | memoryview:
        """``length`` checked bytes from ``offset``, for bytes read once and written elsewhere
        (the eager pages the staging writes). Here, through the segments (chunks) kept, as
        :meth:`read`; :class:`RawPages` reads only the blocks that hold them, and keeps none."""
        return b"".join(self.read(offset, length))

    def ahead(self, offset: int, length: int) -> None:
        """Check the segments covering ``[offset, offset + length)`` in the pool, now."""
        if offset >= self.size:
            return
        i = bisect.bisect_right(self.starts, offset) - 1
        j = bisect.bisect_left(self.starts, min(self.size, offset + length))
        for k in range(max(i, 0), min(max(j, i + 1), len(self.starts))):
            with self._lock:
                known = k in self._cache or k in self._loading
            if not known:
                self._hint(k)
                self.pool.submit(self._quietly, k)

    def _quietly(self, i: int) -> None:
        try:
            self._segment(i)
        except PageDamaged:
            pass  # reported by the read that needs it

    def close(self) -> None:
        with self._lock:
            self._cache.clear()
            self._cached = 0


class RawPages(_Segmented):
    """Pages file ``path`` checked against ``sums``."""

    def __init__(self, path: Path | str, sums: PageSums, pool: Executor, keep: int = KEEP):
        super().__init__(pool, keep)
        self.path = Path(path)
        self.name = self.path.name
        self.sums = sums
        self.segment = max(SEGMENT // sums.block, 1) * sums.block
        self.fd = os.open(self.path, os.O_RDONLY)
        size = os.fstat(self.fd).st_size
        if size != sums.size:
            os.close(self.fd)
            raise PageDamaged(f"{self.name}: {size} bytes, its page checksums describe {sums.size}")
        self.size = size
        self.starts = list(range(0, size, self.segment)) or [0]

    def zero_ranges(self) -> list[tuple[int, int]]:
        """The blocks whose checksum is that of zero bytes (:attr:`.PageSums.zero`)."""
        return block_ranges(self.sums.zero, self.sums.block, self.size)

    def _runs(self, i: int) -> list[tuple[int, int]]:
        """Segment ``i``'s blocks that must be read, as ``[(offset, length), …]`` runs:
        those whose checksum is not that of zero bytes (:attr:`.PageSums.zero`)."""
        start = self.starts[i]
        return self._runs_in(start, min(start + self.segment, self.size))

    def _runs_in(self, start: int, end: int) -> list[tuple[int, int]]:
        """The blocks of ``[start, end)`` (block-aligned ``start``) that must be read, as
        :meth:`_runs` gives them."""
        block, zero = self.sums.block, self.sums.zero
        if not zero:
            return [(start, end - start)]
        runs: list[tuple[int, int]] = []
        for b in range(start // block, -(-end // block)):
            if b in zero:
                continue
            off = b * block
            n = min(block, end - off)
            if runs and runs[-1][0] + runs[-1][1] == off:
                runs[-1] = (runs[-1][0], runs[-1][1] + n)
            else:
                runs.append((off, n))
        return runs

    def _load(self, i: int) -> bytes | bytearray:
        start = self.starts[i]
        return self._blocks(start, min(start + self.segment, self.size))

    def _blocks(self, start: int, end: int) -> bytes | bytearray:
        """The checked bytes of ``[start, end)`` (block-aligned ``start``); the blocks known
        to be zero are not read (counted in :attr:`zero_bytes`)."""
        runs = self._runs_in(start, end)
        if runs == [(start, end - start)]:  # nothing known to be zero: one read
            data = self._pread(start, end - start)
            self._check(start, data)
            return data
        data = bytearray(end - start)  # zero-filled: the blocks known to be zero stay so
        for off, n in runs:
            piece = self._pread(off, n)
            self._check(off, piece)
            data[off - start : off - start + n] = piece
        with self._lock:
            self.zero_bytes += end - start - sum(n for _, n in runs)
        return data

    def read_once(self, offset: int, length: int) -> bytes | memoryview:
        """:meth:`_Segmented.read_once`, reading and checking only the blocks of the page
        sums (64 KiB) that hold the bytes asked for, not whole segments (1 MiB): the
        staging's eager pages are a few pages here and there, 47.5 MB of a GPU notebook's
        image, and whole segments read more than twice that (docs/lazy-restore.md)."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise PageDamaged(
                f"{self.name}: bytes {offset}-{offset + length} beyond its {self.size}"
            )
        block = self.sums.block
        start = offset - offset % block
        end = min(-(-(offset + length) // block) * block, self.size)
        data = self._blocks(start, end)
        with self._lock:
            self.loaded_bytes += end - start
        return memoryview(data)[offset - start : offset - start + length]

    def _pread(self, offset: int, n: int) -> bytes:
        try:
            data = os.pread(self.fd, n, offset)
        except OSError as e:
            raise PageDamaged(f"{self.name}: cannot read bytes {offset}-{offset + n}: {e}") from e
        if len(data) != n:
            raise PageDamaged(f"{self.name}: short read at {offset} ({len(data)} of {n} bytes)")
        return data

    def _check(self, offset: int, data: bytes) -> None:
        bad = self.sums.check(offset, data)
        if bad is not None:
            block = self.sums.block
            raise PageDamaged(
                f"{self.name}: the {block >> 10} KiB block at offset {bad} (pages "
                f"{bad // 4096}-{(bad + block) // 4096 - 1} of the file) does not match its "
                "checksum (damaged)"
            )

    def _hint(self, i: int) -> None:
        for off, n in self._runs(i):
            try:
                os.posix_fadvise(self.fd, off, n, os.POSIX_FADV_WILLNEED)
            except OSError:
                return

    def close(self) -> None:
        super().close()
        os.close(self.fd)


class ChunkPages(_Segmented):
    """Pages file ``name`` stored as ``refs`` (``[[id, length], …]``) in ``store``'s ``space``."""

    def __init__(self, store: ChunkStore, space: str, name: str, refs: list, pool: Executor,
                 keep: int = KEEP):  # fmt: skip
        super().__init__(pool, keep)
        self.store = store
        self.space = space
        self.name = name
        self.refs = [(cid, int(n)) for cid, n in refs]
        self.starts = []
        pos = 0
        for _, n in self.refs:
            self.starts.append(pos)
            pos += n
        self.size = pos
        if not self.starts:
            self.starts = [0]
        self.zero = self._zero_chunks()

    def _zero_chunks(self) -> frozenset[int]:
        """The indices of the chunks whose id is that of zero bytes of their length.

        Zero-filled memory is cut into chunks of the smallest size (every page is a cut
        point: :func:`.chunks.cut_points`), so its chunks repeat; only the lengths of the
        chunks that repeat most (by bytes) are hashed as zeros, a few sha256 of at most a
        chunk each, not one per chunk."""
        repeated = sorted((c * ref[1], ref) for ref, c in Counter(self.refs).items() if c > 1)
        zero = set()
        for _, (cid, n) in repeated[-ZERO_CANDIDATES:]:
            if cid == self.store.zero_id(self.space, n):
                zero.add((cid, n))
        return frozenset(i for i, ref in enumerate(self.refs) if ref in zero)

    def zero_ranges(self) -> list[tuple[int, int]]:
        """The chunks whose id is that of zero bytes (neighbours not joined:
        :func:`.pagemap.with_zero_pages` joins the zero runs they give)."""
        return [(self.starts[i], self.starts[i] + self.refs[i][1]) for i in sorted(self.zero)]

    def _load(self, i: int) -> bytes:
        cid, n = self.refs[i]
        if i in self.zero:  # its id says what it holds: not read
            with self._lock:
                self.zero_bytes += n
            return bytes(n)
        try:
            return self.store.get(self.space, cid, n)
        except (OSError, ValueError) as e:
            raise PageDamaged(
                f"{self.name}: chunk {cid[:12]}… (bytes {self.starts[i]}-{self.starts[i] + n} of "
                f"the file) cannot be used: {e}"
            ) from e

    def _hint(self, i: int) -> None:
        if i not in self.zero:
            self.store.prefetch(self.space, self.refs[i][0])
