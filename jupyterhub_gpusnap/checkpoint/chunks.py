"""Content-addressed, compressed (and optionally encrypted) storage for checkpoint images.

With ``LocalBackend.storage = "chunks"`` the image files CRIU writes are cut into
chunks, each chunk is compressed with zstd in a thread pool (zstd, hashlib and AES
release the GIL: this scales with the cores) and stored once under its content hash::

    <checkpoint_dir>/.chunks/<key id | plain>/<id[:2]>/<id>

so identical data — the same model weights in ten users' servers, or the unchanged
memory of a server suspended a second time — is stored once. A checkpoint's manifest
lists, per image file, its chunks as ``[id, length]``; the raw files are deleted once
the chunks are durable.

**Where chunks are cut.** CRIU's ``pages-*.img`` hold memory page by page (4 KiB),
in address order. A fixed-size cut would lose every match as soon as one earlier page
more or less shifts the rest, so cuts are content-defined at page granularity: a page
starts a new chunk when a hash of two of its 8-byte words falls in 1/``avg_pages`` of
the range (bounded by ``min_pages`` and ``max_pages``). The same data then yields the
same chunks wherever it sits in the file. The scan reads two words per page: about
0.1 s per GiB.

**Blob format.** ``b"GSN1"`` + codec (0 raw, 1 zstd) + key id length + key id, then the
payload, sealed with AES-256-GCM (random 96-bit nonce, the header and chunk id as
associated data) when a key is in use. Data that zstd cannot shrink by 3 % is stored
raw, so random data costs no decompression at restore (a streamed restore splices it to
CRIU from the page cache once checked, the others from a memory file they are decoded
into: :meth:`ChunkStore.open_chunk`).

**Integrity.** A chunk's id is the sha256 of its plaintext (salted with a value derived
from the key when encrypted, see :mod:`.keys`); unpacking checks every chunk against its
id, so a damaged chunk is found before CRIU runs. A chunk found stored already when a
checkpoint is packed is read back and compared with the data in hand before it is
trusted (``verify_dedup``); a damaged copy is replaced by that data. A chunk may have a
second copy, the *replica* (the same bytes, so sealed the same way) under
``replica_root``: a read that finds the chunk damaged or missing uses the replica and
repairs the chunk from it, and :meth:`ChunkStore.scrub_chunk` checks both copies and
repairs either from the other (:mod:`.scrub` decides which chunks get a replica). Writes go to a temporary name and are
renamed into place; each new chunk is ``fsync``'ed by the thread that wrote it, and
:meth:`ChunkStore.sync_dirs` then syncs the folders that gained one. (Not ``syncfs``: it
would also flush the raw dump CRIU just wrote next to it, which is deleted unread once
packed — writing it to the disk would double a suspension's disk traffic.)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path

from .keys import Key

STORE = ".chunks"
PLAIN = "plain"
MAGIC = b"GSN1"
RAW, ZSTD = 0, 1
PAGE = 4096
_K = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1
_SMALL = 64 << 10  # files below this are one chunk, read without mmap


class DamagedChunk(ValueError):
    """A chunk file is missing or does not hold its chunk (unlike a missing key, which is
    a plain ValueError: no other copy helps there)."""


def cut_points(buf, avg_pages: int = 512, min_pages: int = 128, max_pages: int = 2048) -> list[int]:
    """Byte offsets where chunks of ``buf`` start (content-defined, page granular).

    ``avg_pages`` must be a power of two. The first offset is always 0.
    """
    n = len(buf) // PAGE
    if n <= min_pages:
        return [0]
    words = memoryview(buf)[: n * PAGE].cast("B").cast("Q")
    a = words[0::512].tolist()
    b = words[257::512].tolist()
    shift = 64 - (avg_pages.bit_length() - 1)
    cuts = [0]
    last = 0
    for i in range(min_pages, n):
        if i - last < min_pages:
            continue
        if i - last >= max_pages or (((a[i] ^ b[i]) * _K) & _M64) >> shift == 0:
            cuts.append(i * PAGE)
            last = i
    return cuts


def private_mkdir(path: Path) -> None:
    """Create ``path`` and its missing parents, each 0700 (``Path.mkdir(parents=True)``
    would make the parents 0755: a chunk store's folders are for root alone)."""
    missing = []
    p = Path(path)
    while not p.is_dir():
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(p, 0o700)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Packed:
    """One file as chunks: its digest, size and ``[[id, length], …]``, plus byte counts."""

    digest: str
    size: int
    chunks: list[list] = field(default_factory=list)
    stored_bytes: int = 0  # bytes its chunks take on disk (shared ones included)
    new_bytes: int = 0  # bytes this file added to the store


class ChunkStore:
    """The chunk store under ``root`` (``<checkpoint_dir>/.chunks``); see the module docstring.

    ``keys``: newest first; the first seals new chunks, any opens the chunks it sealed.
    Blocking methods: call them from a thread that is not one of ``pool``'s.
    """

    def __init__(
        self,
        root: Path | str,
        pool: Executor,
        *,
        level: int = 1,
        keys: list[Key] | None = None,
        avg_pages: int = 512,
        replica_root: Path | str | None = None,
        replicate_all: bool = False,
        verify_dedup: bool = True,
        on_damage: Callable[[str, str, str, bool, str], None] | None = None,
    ):
        self.root = Path(root)
        self.pool = pool
        self.level = level
        self.keys = list(keys or [])
        self.avg_pages = avg_pages
        # second copies: where (None: none kept), and whether every new chunk gets one
        self.replica_root = Path(replica_root) if replica_root else None
        self.replicate_all = bool(replicate_all and replica_root)
        self.verify_dedup = verify_dedup
        # on_damage(space, id, found_by, repaired, what): a damaged or missing chunk was
        # found while writing ("write") or reading ("read") it, and mended or not
        self.on_damage = on_damage
        self._local = threading.local()
        self._writing: dict[tuple[str, str], threading.Event] = {}
        self._writing_lock = threading.Lock()
        self._new_dirs: set[Path] = set()  # folders that gained a chunk since sync_dirs()
        self._zero_ids: dict[tuple[str, int], str] = {}

    # ------------------------------------------------------------ naming
    @property
    def key(self) -> Key | None:
        return self.keys[0] if self.keys else None

    @property
    def space(self) -> str:
        """Where new chunks go: the current key's id, or ``plain``."""
        return self.key.id if self.key else PLAIN

    def path(self, space: str, chunk_id: str) -> Path:
        return self.root / space / chunk_id[:2] / chunk_id

    def replica_path(self, space: str, chunk_id: str) -> Path | None:
        """Where a chunk's second copy is (or would be); None when no replicas are kept."""
        if self.replica_root is None:
            return None
        return self.replica_root / space / chunk_id[:2] / chunk_id

    def _damaged(self, space: str, cid: str, found_by: str, repaired: bool, what: str) -> None:
        if self.on_damage is not None:
            self.on_damage(space, cid, found_by, repaired, what)

    def _key_for(self, key_id: str) -> Key:
        for k in self.keys:
            if k.id == key_id:
                return k
        raise ValueError(
            f"chunk sealed with key {key_id!r}, which is not in the key file: put that key back "
            "(LocalBackend.encryption_key_file) to restore this checkpoint"
        )

    def require_key(self, space: str) -> None:
        """Raise ValueError (naming the fix) unless chunks sealed in ``space`` can be opened."""
        if space != PLAIN:
            self._key_for(space)

    def _chunk_id(self, data, key: Key | None) -> str:
        h = hashlib.sha256(key.id_salt) if key else hashlib.sha256()
        h.update(data)
        return h.hexdigest()

    def zero_id(self, space: str, length: int) -> str:
        """The id a chunk of ``length`` zero bytes has in ``space``: a chunk with that id
        holds zeros, known without reading it (ValueError when ``space``'s key is not at
        hand, as for any of its chunks)."""
        cid = self._zero_ids.get((space, length))
        if cid is None:
            key = None if space == PLAIN else self._key_for(space)
            cid = self._zero_ids[(space, length)] = self._chunk_id(bytes(length), key)
        return cid

    def _zc(self):
        import zstandard

        z = getattr(self._local, "zc", None)
        if z is None:
            z = self._local.zc = zstandard.ZstdCompressor(level=self.level)
        return z

    def _zd(self):
        import zstandard

        z = getattr(self._local, "zd", None)
        if z is None:
            z = self._local.zd = zstandard.ZstdDecompressor()
        return z

    # ------------------------------------------------------------ write
    def _put(self, data) -> tuple[str, int, int]:
        """Store one chunk; return (id, bytes on disk, bytes newly written)."""
        key = self.key
        space = key.id if key else PLAIN
        cid = self._chunk_id(data, key)
        final = self.path(space, cid)
        with self._writing_lock:
            busy = self._writing.get((space, cid))
            if busy is None:
                self._writing[(space, cid)] = threading.Event()
        if busy is not None:  # another thread writes this very chunk: share its result
            busy.wait()
            try:
                return cid, final.stat().st_size, 0
            except FileNotFoundError:
                raise OSError(f"chunk {cid[:12]}… was not written by its other writer") from None
        try:
            return self._put_new(data, key, space, cid, final)
        finally:
            with self._writing_lock:
                self._writing.pop((space, cid)).set()

    def _put_new(
        self, data, key: Key | None, space: str, cid: str, final: Path
    ) -> tuple[str, int, int]:
        try:
            size = final.stat().st_size  # stored by an earlier checkpoint
        except FileNotFoundError:
            size = None
        replica = self.replica_path(space, cid) if self.replicate_all else None
        if size is not None:
            if not self.verify_dedup and (replica is None or replica.exists()):
                return cid, size, 0
            blob = _read_or_none(final)
            try:
                if blob is None:
                    raise DamagedChunk(f"chunk {cid[:12]}… vanished from {final.parent}")
                self._decode(blob, cid, len(data))
            except DamagedChunk as e:  # the data in hand replaces it: a repair
                self._damaged(space, cid, "write", True, str(e))
            else:
                added = 0
                if replica is not None and not replica.exists():
                    added = self._install(replica, [blob])
                return cid, size, added
        packed = self._zc().compress(data) if self.level > 0 else b""
        if packed and len(packed) < len(data) * 0.97:
            codec, payload = ZSTD, packed
        else:
            codec, payload = RAW, data
        kid = key.id.encode() if key else b""
        header = MAGIC + bytes((codec, len(kid))) + kid
        body = key.seal(payload, header + cid.encode()) if key else payload
        n = self._install(final, [header, body])
        added = n + (self._install(replica, [header, body]) if replica is not None else 0)
        return cid, n, added

    def _install(self, final: Path, parts: list) -> int:
        """Write a chunk file durably and atomically (temporary name, fsync, rename; its
        folder is synced by :meth:`sync_dirs`); the bytes written."""
        if not final.parent.is_dir():
            private_mkdir(final.parent)
            with self._writing_lock:
                self._new_dirs.update((final.parent.parent, final.parent.parent.parent))
        tmp = final.parent / f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for part in parts:
                _write_all(fd, memoryview(part))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        with self._writing_lock:
            self._new_dirs.add(final.parent)
        return sum(len(part) for part in parts)

    def pack_file(self, path: Path) -> Packed:
        """Store ``path`` as chunks (in ``pool``); return its :class:`Packed` record."""
        packer = _FilePacker(self, path)
        packer.step(final=True)
        return packer.result()

    @staticmethod
    def _collect(futures, lengths: list[int], size: int) -> Packed:
        h = hashlib.sha256()
        out = Packed(digest="", size=size)
        for fut, length in zip(futures, lengths, strict=True):
            cid, stored, new = fut.result()
            h.update(bytes.fromhex(cid))
            out.chunks.append([cid, length])
            out.stored_bytes += stored
            out.new_bytes += new
        out.digest = h.hexdigest()
        return out

    @contextlib.contextmanager
    def _locked(self, mode: int):
        """flock on ``<root>/.lock``: packs share it, a sweep needs it alone (any process)."""
        private_mkdir(self.root)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)

    def sync_dirs(self) -> None:
        """fsync the folders that gained chunks (their new names are then durable)."""
        with self._writing_lock:
            dirs, self._new_dirs = self._new_dirs, set()
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            _fsync_dir(d)

    def follow(self, folder: Path | str, interval: float = 0.1) -> Follower:
        """Start packing ``folder``'s growing ``pages-*.img`` files while CRIU writes them;
        :meth:`Follower.finish` packs the rest once the dump is done (see :class:`Follower`)."""
        return Follower(self, Path(folder), interval)

    def pack(self, paths: Iterable[Path]) -> dict[str, Packed]:
        """Store every file of ``paths``, then make the store durable; {name: Packed}.

        Holds the store's lock shared: no sweep (in any process) runs meanwhile. The caller
        must record the chunks in a manifest — its checkpoint marked ``writing`` until then,
        which stops sweeps too — before the lock's protection matters again.
        """
        with self._locked(fcntl.LOCK_SH):
            out = {p.name: self.pack_file(p) for p in paths}
            self.sync_dirs()
        return out

    # ------------------------------------------------------------ read
    def get(self, space: str, cid: str, length: int) -> bytes:
        """One chunk's plaintext, checked against its id (ValueError names what is wrong).
        A damaged or missing chunk is read from its replica, if good, and repaired."""
        try:
            return self._decode(self._read(self.path(space, cid), space, cid), cid, length)
        except DamagedChunk as e:
            first = e
        replica = self.replica_path(space, cid)
        if replica is None or not replica.exists():
            self._damaged(space, cid, "read", False, f"{first}; no replica")
            raise first
        try:
            blob = self._read(replica, space, cid)
            data = self._decode(blob, cid, length)
        except DamagedChunk as e:
            self._damaged(space, cid, "read", False, f"{first}; its replica: {e}")
            raise DamagedChunk(f"{first}; its replica too: {e}") from None
        self._repair(space, cid, blob, str(first))
        return data

    def _read(self, path: Path, space: str, cid: str) -> bytes:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise self._missing(space, cid, path) from None

    def _repair(self, space: str, cid: str, blob: bytes, what: str) -> None:
        """A chunk found damaged on a read, put back from its replica's ``blob``."""
        try:
            self._install(self.path(space, cid), [blob])
            self.sync_dirs()
        except OSError as e:
            self._damaged(space, cid, "read", False, f"{what}; read from its replica, which "
                          f"could not be copied back: {e}")  # fmt: skip
            return
        self._damaged(space, cid, "read", True, what)

    def _missing(self, space: str, cid: str, path: Path | None = None) -> DamagedChunk:
        where = (path or self.path(space, cid)).parent.parent
        return DamagedChunk(f"chunk {cid[:12]}… is missing from {where}")

    def _decode(self, blob, cid: str, length: int) -> bytes:
        """A whole chunk file's plaintext, checked against its id."""
        codec, klen = _header(blob, cid)
        header = blob[: 6 + klen]
        kid = bytes(header[6:]).decode(errors="replace")
        body = memoryview(blob)[6 + klen :]
        key = None
        if kid:
            key = self._key_for(kid)
            try:
                body = key.open(body, bytes(header) + cid.encode())
            except ValueError as e:
                raise DamagedChunk(f"chunk {cid[:12]}… is damaged: {e}") from None
        if codec == ZSTD:
            try:
                body = self._zd().decompress(body, max_output_size=length)
            except Exception as e:
                raise DamagedChunk(f"chunk {cid[:12]}… does not decompress: {e}") from None
        elif codec != RAW:
            raise DamagedChunk(f"chunk {cid[:12]}…: unknown codec {codec}")
        if len(body) != length or self._chunk_id(body, key) != cid:
            raise DamagedChunk(f"chunk {cid[:12]}… does not match its checksum (damaged)")
        return body

    def open_raw(self, space: str, cid: str, length: int) -> tuple[int, int] | None:
        """For a chunk stored as it is (codec raw, not encrypted): an open descriptor of its
        file and where its bytes start, once they are checked against the id — so they can
        be spliced from the page cache instead of copied; None for any other chunk (use
        :meth:`get`). Raises ValueError as :meth:`get` does. The caller closes the fd.

        The check reads the file's cached pages through a per-thread buffer; a splice of
        the same range right after hands over those very pages (chunk files never change:
        written once, renamed into place, removed only when no checkpoint lists them).
        """
        if space != PLAIN:
            return None
        return self._open_checked(space, cid, length, raw_only=True)

    def open_chunk(self, space: str, cid: str, length: int) -> tuple[int, int]:
        """A file descriptor holding one chunk's checked plaintext and where it starts, to
        be spliced into a pipe (the caller closes it). Raises ValueError as :meth:`get` does.

        A chunk stored as it is comes from its own file (:meth:`open_raw`); any other is
        decoded into a memory file (``memfd``), so the pipe takes page-cache pages either
        way — CRIU copies those out of a pipe at about twice the speed of anonymous memory
        lent with ``vmsplice`` (docs/performance.md). The pages are freed when the pipe
        lets go of them. The chunk file is opened and read once either way.
        """
        return self._open_checked(space, cid, length, raw_only=False)

    def _open_checked(self, space: str, cid: str, length: int, raw_only: bool):
        try:
            return self._open_at(self.path(space, cid), space, cid, length, raw_only)
        except DamagedChunk as e:
            first = e
        replica = self.replica_path(space, cid)
        if replica is None or not replica.exists():
            self._damaged(space, cid, "read", False, f"{first}; no replica")
            raise first
        try:
            out = self._open_at(replica, space, cid, length, raw_only)
        except DamagedChunk as e:
            self._damaged(space, cid, "read", False, f"{first}; its replica: {e}")
            raise DamagedChunk(f"{first}; its replica too: {e}") from None
        try:
            blob = replica.read_bytes()
        except OSError:
            blob = None
        if blob is not None:
            self._repair(space, cid, blob, str(first))
        return out

    def _open_at(self, path: Path, space: str, cid: str, length: int, raw_only: bool):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise self._missing(space, cid, path) from None
        try:
            codec, klen = _header(os.pread(fd, 6, 0), cid)
            if codec == RAW and not klen:
                return fd, self._check_raw(fd, cid, length)
            if raw_only:
                os.close(fd)
                return None  # compressed or sealed: get() reads it whole
            with open(fd, "rb", closefd=False) as f:
                blob = f.read()
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        os.close(fd)
        data = self._decode(blob, cid, length)
        mfd = os.memfd_create("gpusnap-chunk", os.MFD_CLOEXEC)
        try:
            _write_all(mfd, memoryview(data))
        except BaseException:
            os.close(mfd)
            raise
        return mfd, 0

    def _check_raw(self, fd: int, cid: str, length: int) -> int:
        """Check a raw chunk's bytes in ``fd`` against its id; where they start."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < length:
            buf = self._local.buf = bytearray(max(length, 8 << 20))
        view = memoryview(buf)[:length]
        got = os.preadv(fd, [view], 6)
        if (got != length or os.fstat(fd).st_size != length + 6
                or hashlib.sha256(view).hexdigest() != cid):  # fmt: skip
            raise DamagedChunk(f"chunk {cid[:12]}… does not match its checksum (damaged)")
        return 6

    def prefetch(self, space: str, cid: str) -> None:
        """Have the kernel start reading a chunk now (``POSIX_FADV_WILLNEED``, which returns
        at once) so that the :meth:`get` that follows finds it in memory: many reads in
        flight instead of one small read-ahead per chunk. A missing chunk is left for
        :meth:`get` to report."""
        _advise(self.path(space, cid), os.POSIX_FADV_WILLNEED)

    def _get_into(self, fd: int, space: str, cid: str, length: int, offset: int) -> None:
        _pwrite_all(fd, self.get(space, cid, length), offset)

    def unpack(
        self, space: str, chunks: dict[str, list], sizes: dict[str, int], dest: Path
    ) -> list[str]:
        """Write every file of ``chunks`` into ``dest`` (checked chunk by chunk); the problems.

        Files are written in parallel, chunk by chunk, without fsync: they only feed the
        restore that follows and are deleted after it.
        """
        try:
            self.require_key(space)
        except ValueError as e:
            return [str(e)]
        problems: list[str] = []
        fds = []
        jobs = []
        try:
            for name, refs in chunks.items():
                fd = os.open(dest / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                fds.append(fd)
                os.ftruncate(fd, sizes.get(name, sum(r[1] for r in refs)))
                offset = 0
                for cid, length in refs:
                    jobs.append(
                        (name, self.pool.submit(self._get_into, fd, space, cid, length, offset))
                    )
                    offset += length
            for name, fut in jobs:
                try:
                    fut.result()
                except (OSError, ValueError) as e:
                    problems.append(f"{name}: {e}")
        finally:
            for fd in fds:
                os.close(fd)
        return problems

    def check(self, space: str, chunks: dict[str, list]) -> list[str]:
        """Read back every distinct chunk of ``chunks`` and check it; the problems."""
        seen: dict[str, tuple[str, int]] = {}
        for name, refs in chunks.items():
            for cid, length in refs:
                seen.setdefault(cid, (name, length))
        futs = {cid: self.pool.submit(self.get, space, cid, n) for cid, (_, n) in seen.items()}
        problems = []
        for cid, fut in futs.items():
            try:
                fut.result()
            except (OSError, ValueError) as e:
                problems.append(f"{seen[cid][0]}: {e}")
        return problems

    def drop_cached(self, space: str, chunks: dict[str, list]) -> None:
        """Drop the chunks of ``chunks`` from the page cache (the next read is the disk's)."""
        for cid in {c for refs in chunks.values() for c, _ in refs}:
            _advise(self.path(space, cid), os.POSIX_FADV_DONTNEED)

    # ------------------------------------------------------------ scrub
    def scrub_chunk(
        self, space: str, cid: str, length: int, want_replica: bool
    ) -> tuple[str, int, str]:
        """Re-read one chunk and its replica, check both against the id and mend what it can;
        ``(outcome, bytes read, what was wrong)``. Outcomes: ``ok``; ``replicated`` (a
        replica was wanted and is now written); ``repaired`` (one copy was damaged or
        missing and is now rewritten from the other); ``damaged`` (no intact copy: the
        chunk is lost); ``unchecked`` (sealed with a key not in the key file).
        """
        primary = self.path(space, cid)
        replica = self.replica_path(space, cid)
        blobs = {
            "chunk": _read_or_none(primary),
            "replica": _read_or_none(replica) if replica else None,
        }
        read = sum(len(b) for b in blobs.values() if b is not None)
        bad: dict[str, str] = {}
        for which, blob in blobs.items():
            if blob is None:
                if which == "chunk":
                    bad[which] = str(self._missing(space, cid))
                continue
            try:
                self._decode(blob, cid, length)
            except DamagedChunk as e:
                bad[which] = str(e)
            except ValueError as e:  # the key is not in the key file: cannot tell
                return "unchecked", read, str(e)
        good = next(
            (blobs[w] for w in ("chunk", "replica") if blobs[w] is not None and w not in bad), None
        )
        if good is None:
            what = bad["chunk"] + (f"; its replica: {bad['replica']}" if "replica" in bad else
                                   "; no replica")  # fmt: skip
            return "damaged", read, what
        try:
            if "chunk" in bad:
                self._install(primary, [good])
            if replica is not None and (
                "replica" in bad or (blobs["replica"] is None and want_replica)
            ):
                self._install(replica, [good])
            self.sync_dirs()
        except OSError as e:
            return (
                "damaged",
                read,
                "; ".join([*bad.values(), f"cannot write the good copy back: {e}"]),
            )
        if bad:
            return (
                "repaired",
                read,
                "; ".join(
                    f"{'the replica' if w == 'replica' else 'the chunk file'}: {why}"
                    for w, why in bad.items()
                ),
            )
        return (
            ("replicated" if blobs["replica"] is None and want_replica and replica else "ok"),
            read,
            "",
        )

    # ------------------------------------------------------------ garbage
    def sweep(self, referenced: Callable[[], set[tuple[str, str]] | None]) -> tuple[int, int]:
        """Delete chunks no checkpoint lists (and leftover temporary files); (count, bytes).

        ``referenced()`` gives the ``(space, id)`` pairs in use, or None to call the sweep
        off (a checkpoint being written, an unreadable manifest). It is called with the
        store's lock held alone, so no pack runs meanwhile; if a pack holds it, the sweep
        is skipped (the next one catches up).
        """
        if not self.root.is_dir():
            return 0, 0
        try:
            with self._locked(fcntl.LOCK_EX | fcntl.LOCK_NB):
                keep = referenced()
                return (0, 0) if keep is None else self._sweep(keep)
        except BlockingIOError:
            return 0, 0

    def _sweep(self, referenced: set[tuple[str, str]]) -> tuple[int, int]:
        count = freed = 0
        for root in (self.root, self.replica_root):
            if root is not None and root.is_dir():
                n, b = self._sweep_in(root, referenced)
                count, freed = count + n, freed + b
        return count, freed

    def _sweep_in(self, root: Path, referenced: set[tuple[str, str]]) -> tuple[int, int]:
        count = freed = 0
        for space in root.iterdir():
            if not space.is_dir():
                continue
            for fan in space.iterdir():
                if not fan.is_dir():
                    continue
                for chunk in fan.iterdir():
                    if (space.name, chunk.name) in referenced and not chunk.name.startswith("."):
                        continue
                    try:
                        n = chunk.stat().st_size
                        chunk.unlink()
                    except OSError:
                        continue
                    count += 1
                    freed += n
                try:
                    fan.rmdir()
                except OSError:
                    pass
        return count, freed


class _FilePacker:
    """Packs one file front to back in ``store.pool``, possibly while it still grows.

    Cuts depend only on the bytes since the previous cut, so packing a growing file step
    by step gives exactly the chunks of packing it whole. A step that is not ``final``
    keeps the last (maybe unfinished) chunk for later.
    """

    def __init__(self, store: ChunkStore, path: Path):
        self.store = store
        self.path = path
        self.done = 0
        self.size = 0
        self.futures: list = []
        self.lengths: list[int] = []
        self._maps: list[mmap.mmap] = []

    def step(self, final: bool) -> None:
        st = self.store
        size = self.path.stat().st_size
        end = size if final else size // PAGE * PAGE
        if final:
            self.size = size
        if end <= self.done or (not final and end - self.done < 8 * st.avg_pages * PAGE):
            return
        if end - self.done < _SMALL:  # small files (and small tails): one chunk, no mmap
            with open(self.path, "rb") as f:
                f.seek(self.done)
                data = f.read(end - self.done)
            self.futures.append(st.pool.submit(st._put, data))
            self.lengths.append(len(data))
            self.done += len(data)
            return
        with open(self.path, "rb") as f:
            mm = mmap.mmap(f.fileno(), end, prot=mmap.PROT_READ)
        self._maps.append(mm)
        view = memoryview(mm)[self.done : end]
        cuts = cut_points(view, st.avg_pages, st.avg_pages // 4, st.avg_pages * 4)
        bounds = list(zip(cuts, cuts[1:] + [len(view)], strict=True))
        if not final:
            bounds = bounds[:-1]
        for s, e in bounds:
            self.futures.append(st.pool.submit(st._put, view[s:e]))
            self.lengths.append(e - s)
        if bounds:
            self.done += bounds[-1][1]

    def wait(self) -> None:
        """Wait for every chunk handed out (their errors are :meth:`result`'s)."""
        for fut in self.futures:
            fut.exception()

    def result(self) -> Packed:
        try:
            return self.store._collect(self.futures, self.lengths, self.size)
        finally:
            self.wait()
            self.futures = []
            for mm in self._maps:
                with contextlib.suppress(BufferError):
                    mm.close()
            self._maps = []


class Follower:
    """Packs a dump's ``pages-*.img`` files while CRIU writes them (a thread polls every
    ``interval`` s), so that little is left to pack when the dump ends.

    Holds the store's lock shared from start to :meth:`finish` or :meth:`close`.
    """

    def __init__(self, store: ChunkStore, folder: Path, interval: float = 0.1):
        self.store = store
        self.folder = folder
        self.interval = interval
        self.packers: dict[str, _FilePacker] = {}
        self._lock = store._locked(fcntl.LOCK_SH)
        self._lock.__enter__()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpusnap-follow", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for path in sorted(self.folder.glob("pages-*.img")):
                packer = self.packers.setdefault(path.name, _FilePacker(self.store, path))
                try:
                    packer.step(final=False)
                except (OSError, ValueError):
                    pass  # finish() packs it from where this stopped

    def _halt(self) -> None:
        self._stop.set()
        self._thread.join()

    def finish(self, paths: Iterable[Path]) -> dict[str, Packed]:
        """Pack what is left of ``paths`` (the finished dump's image files), make the store
        durable and release it; {name: Packed} as :meth:`ChunkStore.pack` gives."""
        try:
            self._halt()
            out = {}
            for path in paths:
                packer = self.packers.get(path.name) or _FilePacker(self.store, path)
                packer.step(final=True)
                out[path.name] = packer.result()
            self.store.sync_dirs()
            return out
        finally:
            self.close()

    def close(self) -> None:
        """Stop (the dump failed): wait for chunks in flight, release the store."""
        if self._lock is None:
            return
        self._halt()
        for packer in self.packers.values():
            packer.wait()
            packer.futures = []
        self._lock.__exit__(None, None, None)
        self._lock = None


def _header(blob, cid: str) -> tuple[int, int]:
    """A chunk file's codec and key id length (DamagedChunk when it is not a chunk)."""
    if len(blob) < 6 or bytes(blob[:4]) != MAGIC:
        raise DamagedChunk(f"chunk {cid[:12]}… is not a gpusnap chunk (damaged header)")
    return blob[4], blob[5]


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _advise(path: Path, advice: int) -> None:
    """``posix_fadvise`` a whole file; a file that is missing or cannot be read is left alone."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, advice)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n
