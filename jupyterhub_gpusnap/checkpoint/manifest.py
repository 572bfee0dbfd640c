"""The manifest of one local checkpoint folder, and the checks that prove its image intact.

One folder per checkpoint holds CRIU's image files, CRIU's own logs and
``manifest.json``. The manifest is the folder's truth: who (user, server), when,
what state (``writing`` → ``verified`` → ``restored`` | ``failed``), the sizes, the
GPU it came from, and a checksum of every image file. It is written atomically
(temporary file + rename, mode 0600) so a crash never leaves half a manifest.

Checksums are chunked: a file is cut into ``chunk_bytes`` pieces (64 MiB by
default), each piece is hashed with sha256 on its own, in a thread pool (hashlib
releases the GIL, so this scales with the cores), and the file's checksum is the
sha256 over its pieces' digests, in order. ``files`` maps each image file to that
hex digest, ``sizes`` to its length. A manifest with ``chunk_bytes == 0`` (written
before chunking) holds the plain sha256 of each whole file and still verifies.

:func:`seal_image` runs right after the dump, while the image is still in the page
cache: it hashes every file from memory and, at the same time, ``fsync``s every file
(and the folder), so that the checksums describe exactly what the disk will hold once
sealing returns. It does not read the image back from the disk: that doubled the
time of a checkpoint for a check the disk's own error detection already makes (see
``docs/performance.md``). :func:`drop_cached` + :func:`verify_image` give the old
read-back check to admins who want it (``LocalBackend.verify_read_back``).

:func:`check_complete` is the structural check that makes an image "verified" along
with the checksums: every file CRIU must write is there and non-empty, and CRIU's log
ends with its success line.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import threading
from collections.abc import Iterable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

MANIFEST = "manifest.json"
STATUSES = ("writing", "verified", "restored", "failed")
CHUNK_BYTES = 64 << 20
DUMP_LOG = "dump.log"
DUMP_OK = b"Dumping finished successfully"

# Files in a checkpoint folder that are not part of the image (written at or after restore).
_NOT_IMAGE = {MANIFEST, "restore.pid", "stats-restore"}
_READ = 4 << 20  # read size inside a chunk: bounds each hashing thread's memory


def is_image_file(name: str) -> bool:
    """True for CRIU image files; False for logs, the manifest and restore-time files."""
    return not (name in _NOT_IMAGE or name.endswith(".log") or name.startswith("."))


def is_pages_file(name: str) -> bool:
    """True for ``pages-*.img``: the memory contents, nearly all of an image's bytes."""
    return name.startswith("pages-") and name.endswith(".img")


@dataclass
class Manifest:
    """What ``manifest.json`` holds (see the module docstring)."""

    user: str
    server: str
    created: float
    status: str = "writing"
    criu_version: str = ""
    driver_version: str = ""
    gpu_model: str = ""
    gpu_count: int = 0
    gpu_bytes: int = 0
    image_bytes: int = 0
    files: dict[str, str] = field(default_factory=dict)
    # Bytes per checksum chunk of ``files``; 0: each digest is the sha256 of the whole file.
    chunk_bytes: int = 0
    sizes: dict[str, int] = field(default_factory=dict)
    # How the image was verified before the tree was killed: "page-cache" or "read-back".
    verification: str = ""
    pid: int = 0
    ip: str = ""
    port: int = 0
    error: str = ""
    tcp_mode: str = "close"
    shell_job: bool = False
    cuda_pids: list[int] = field(default_factory=list)
    time_to_gpu_free_s: float | None = None
    dump_seconds: float | None = None
    seal_seconds: float | None = None
    verified_at: float | None = None
    restored_at: float | None = None
    # The server's Hub API token, read from its environment: the restored server still
    # uses it. The image holds it anyway; it never leaves this root-only folder otherwise.
    api_token: str = ""
    # "files": CRIU's image files in the folder, as written; "chunks": stored in the
    # chunk store (see chunks.py) as ``chunks`` = {file: [[chunk id, length], …]}, in
    # the store's ``key_id`` space ("plain" when not encrypted).
    storage: str = "files"
    key_id: str = ""
    chunks: dict[str, list] = field(default_factory=dict)
    stored_bytes: int = 0  # bytes the image's chunks take on disk (shared ones included)
    new_bytes: int = 0  # bytes this checkpoint added to the chunk store
    extra: dict = field(default_factory=dict)

    def save(self, folder: Path | str, durable: bool = True) -> None:
        """Write atomically as ``<folder>/manifest.json`` (mode 0600).

        ``durable=False`` skips the fsync: the file survives a crash of the service but
        not of the machine (used where speed matters and a power loss would lose the
        state the manifest describes anyway).
        """
        folder = Path(folder)
        tmp = folder / f".{MANIFEST}.tmp"
        data = json.dumps(asdict(self), indent=1, sort_keys=True).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, folder / MANIFEST)

    @classmethod
    def load(cls, folder: Path | str) -> Manifest:
        """Read ``<folder>/manifest.json``; unknown keys go to ``extra`` (newer writers)."""
        raw = json.loads((Path(folder) / MANIFEST).read_text())
        known = {f.name for f in fields(cls)}
        extra = raw.pop("extra", {}) or {}
        extra.update({k: v for k, v in raw.items() if k not in known})
        return cls(**{k: v for k, v in raw.items() if k in known}, extra=extra)


def image_files(folder: Path | str) -> list[Path]:
    """The image files of a checkpoint folder, sorted by name."""
    return sorted(p for p in Path(folder).iterdir() if p.is_file() and is_image_file(p.name))


# ------------------------------------------------------------------ completeness
def check_complete(folder: Path | str) -> list[str]:
    """What is missing for ``folder`` to be a complete CRIU dump (empty: complete).

    Every image file but ``pages-*.img`` starts with CRIU's magic, so none may be empty;
    ``inventory.img``, ``pstree.img``, ``files.img``, at least one ``fdinfo-*.img``,
    ``pages-*.img`` and, per process, ``core-N``, ``mm-N`` and ``pagemap-N`` must exist;
    and ``dump.log`` must end with CRIU's success line.
    """
    folder = Path(folder)
    sizes = {p.name: p.stat().st_size for p in image_files(folder)}
    problems = []
    for name in ("inventory.img", "pstree.img", "files.img"):
        if name not in sizes:
            problems.append(f"{name}: missing")
    for prefix in ("core-", "mm-", "pagemap-", "pages-", "fdinfo-"):
        if not any(n.startswith(prefix) and n.endswith(".img") for n in sizes):
            problems.append(f"{prefix}*.img: missing")
    for name in sorted(sizes):
        m = re.fullmatch(r"mm-(\d+)\.img", name)
        if m:
            for other in (f"core-{m[1]}.img", f"pagemap-{m[1]}.img"):
                if other not in sizes:
                    problems.append(f"{other}: missing (process {m[1]} has {name})")
        if sizes[name] == 0 and not is_pages_file(name):
            problems.append(f"{name}: empty")
    if not _log_ends_ok(folder / DUMP_LOG):
        problems.append(f"{DUMP_LOG}: does not end with '{DUMP_OK.decode()}'")
    return problems


def _log_ends_ok(log: Path) -> bool:
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 512))
            tail = f.read().rstrip().splitlines()
    except OSError:
        return False
    return bool(tail) and tail[-1].endswith(DUMP_OK)


# ------------------------------------------------------------------ checksums
def _hash_range(path: Path, offset: int, length: int) -> bytes:
    """sha256 digest of ``length`` bytes of ``path`` from ``offset`` (short if the file is)."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        end = offset + length
        while offset < end:
            data = os.pread(fd, min(_READ, end - offset), offset)
            if not data:
                break
            h.update(data)
            offset += len(data)
    finally:
        os.close(fd)
    return h.digest()


def _hash_whole(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for data in iter(lambda: f.read(_READ), b""):
            h.update(data)
    return h.hexdigest()


def hash_files(
    paths: Iterable[Path], pool: Executor, chunk_bytes: int = CHUNK_BYTES
) -> dict[str, tuple[str, int]]:
    """{name: (checksum, size)} of ``paths``, every chunk hashed as its own task in ``pool``.

    ``chunk_bytes == 0`` hashes each whole file as one task (manifests written before
    chunking). Blocking: call it from a thread that is not one of ``pool``'s.
    """
    jobs = {}
    for path in paths:
        size = path.stat().st_size
        if chunk_bytes <= 0:
            jobs[path.name] = (size, pool.submit(_hash_whole, path))
            continue
        starts = range(0, max(size, 1), chunk_bytes)
        jobs[path.name] = (size, [pool.submit(_hash_range, path, s, chunk_bytes) for s in starts])
    out = {}
    for name, (size, futures) in jobs.items():
        if chunk_bytes <= 0:
            out[name] = (futures.result(), size)
        else:
            joined = b"".join(f.result() for f in futures)
            out[name] = (hashlib.sha256(joined).hexdigest(), size)
    return out


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal_image(
    folder: Path | str, pool: Executor, chunk_bytes: int = CHUNK_BYTES
) -> tuple[dict[str, str], dict[str, int], int]:
    """Checksum and make durable every image file; return (files, sizes, total bytes).

    Hashes from the page cache in ``pool`` while other threads ``fsync`` each file, then
    the folder. Also tightens permissions to 0600 (images hold the server's memory:
    secrets). Blocking: run it in a thread that is not one of ``pool``'s.
    """
    folder = Path(folder)
    paths = image_files(folder)
    for path in paths:
        os.chmod(path, 0o600)
    with ThreadPoolExecutor(
        max_workers=max(1, min(16, len(paths))), thread_name_prefix="fsync"
    ) as io:
        synced = [io.submit(_fsync, p) for p in paths]
        hashed = hash_files(paths, pool, chunk_bytes)
        for f in synced:
            f.result()
    _fsync(folder)
    files = {name: digest for name, (digest, _) in hashed.items()}
    sizes = {name: size for name, (_, size) in hashed.items()}
    return files, sizes, sum(sizes.values())


def drop_cached(folder: Path | str) -> None:
    """Drop the (clean, fsync'ed) image files from the page cache: the next read is the disk's."""
    for path in image_files(folder):
        drop_file_cached(path)


def drop_file_cached(path: Path | str) -> None:
    """Write ``path`` out and drop it from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def verify_image(
    folder: Path | str,
    expected: dict[str, str],
    *,
    chunk_bytes: int = 0,
    sizes: dict[str, int] | None = None,
    names: Iterable[str] | None = None,
    pool: Executor | None = None,
) -> list[str]:
    """Re-read the image and compare with ``expected``; return the problems (empty: intact).

    ``names`` limits the checksums to those files (the inventory — extra, missing or
    wrongly sized files — is always checked in full). ``pool`` hashes in parallel; without
    one, a pool sized by the CPU count is used. Blocking: run it in a thread.
    """
    folder = Path(folder)
    if not expected:
        return ["the manifest lists no image files"]
    problems = []
    present = {p.name for p in image_files(folder)}
    for name in sorted(present - set(expected)):
        problems.append(f"{name}: not in the manifest")
    for required in ("inventory.img", "pstree.img"):
        if required not in expected:
            problems.append(f"{required}: missing from the image (not a CRIU dump)")
    wanted = set(expected) if names is None else set(names)
    todo = []
    for name in sorted(expected):
        path = folder / name
        if name not in present:
            problems.append(f"{name}: missing")
        elif sizes and name in sizes and path.stat().st_size != sizes[name]:
            problems.append(f"{name}: {path.stat().st_size} bytes, {sizes[name]} recorded")
        elif name in wanted:
            todo.append(path)
    own = pool is None
    pool = pool or ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
    try:
        got = hash_files(todo, pool, chunk_bytes)
    finally:
        if own:
            pool.shutdown()
    for name, (digest, _) in sorted(got.items()):
        if digest != expected[name]:
            problems.append(f"{name}: sha256 {digest[:12]}… differs from {expected[name][:12]}…")
    return problems


# ------------------------------------------------------------------ early writeback
_SYNC_FILE_RANGE_WRITE = 2


def _libc_sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


class Writeback:
    """Starts the disk writes of image files while CRIU is still writing them.

    A background thread looks at the folder every ``interval`` seconds and asks the
    kernel (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not wait) to write
    out what has been added to each file since. Without it the kernel may keep
    gigabytes dirty until the final ``fsync``, which then waits for all of them.
    Changes nothing in the files; a no-op where ``sync_file_range`` is unavailable.
    Use as a context manager around the dump.
    """

    def __init__(self, folder: Path | str, interval: float = 0.1, min_bytes: int = 8 << 20):
        self.folder = Path(folder)
        self.interval = interval
        self.min_bytes = min_bytes
        self._stop = threading.Event()
        self._sync = _libc_sync_file_range()
        self._done: dict[str, tuple[int, int]] = {}  # name -> (fd, bytes asked for)
        self._thread = threading.Thread(target=self._run, name="writeback", daemon=True)
        self.requested = 0

    def __enter__(self) -> Writeback:
        if self._sync is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        for fd, _ in self._done.values():
            os.close(fd)
        self._done.clear()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._step()
            except OSError:
                continue

    def _step(self) -> None:
        for entry in os.scandir(self.folder):
            if not is_pages_file(entry.name):
                continue
            if entry.name not in self._done:
                self._done[entry.name] = (os.open(entry.path, os.O_RDONLY), 0)
            fd, done = self._done[entry.name]
            size = os.fstat(fd).st_size
            if size - done >= self.min_bytes:
                self._sync(fd, done, size - done, _SYNC_FILE_RANGE_WRITE)
                self._done[entry.name] = (fd, size)
                self.requested += size - done


def verify_checkpoint(folder: Path | str) -> list[str]:
    """Check a checkpoint folder against its own manifest; return the problems (empty: intact).

    For admins and scripts (``python -c "...; print(verify_checkpoint(D) or 'intact')"``):
    reads every image file once, in parallel.
    """
    m = Manifest.load(folder)
    return verify_image(folder, m.files, chunk_bytes=m.chunk_bytes, sizes=m.sizes)
