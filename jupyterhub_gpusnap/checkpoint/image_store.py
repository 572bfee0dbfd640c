"""Where a local checkpoint's image is kept: the storage axis of :class:`LocalBackend`,
apart from what writes the image (CRIU, the dumper).

One interface, :class:`ImageStore`, two stores (``LocalBackend.storage``):

- :class:`FilesStore` (``files``): CRIU's files stay in the checkpoint's folder, each
  checksummed in the manifest (``manifest.seal_image``); a restore checks the small files
  first and the pages while CRIU reads them.
- :class:`ChunksStore` (``chunks``): the files are cut into content-addressed chunks in
  the shared chunk store (``chunks.py``: deduplicated, compressed, encrypted when a key
  is set); a restore streams them to CRIU (``streamer.py``) or unpacks them first.

A store is asked at four points of a checkpoint's life: while CRIU writes
(:meth:`ImageStore.begin`, :meth:`ImageStore.writeback`), when the dump is made durable
and checked (:meth:`ImageStore.seal`), once it is verified (:meth:`ImageStore.after_verified`)
and when it is restored (:meth:`ImageStore.restore_source`). The settings are
``LocalBackend``'s traits, read from the backend each time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from . import scrub as chunk_scrub
from .base import CheckpointError, CheckpointInfo, CheckpointRefused
from .chunks import STORE, ChunkStore, Follower
from .file_pages import is_map_file, read_ahead_image
from .keys import KeyFileError
from .manifest import (
    Manifest,
    Writeback,
    drop_cached,
    image_files,
    is_pages_file,
    seal_image,
    verify_image,
)
from .streamer import SOCKET_NAME as STREAMER_SOCKET
from .streamer import ChunkStreamer

if TYPE_CHECKING:
    from .local import LocalBackend


def drop_image_files(folder: Path) -> int:
    """Delete a checkpoint folder's image files (not its logs or manifest); the bytes freed.
    For a failed checkpoint, and for the raw files of one kept as chunks."""
    freed = 0
    for path in image_files(folder):
        try:
            freed += path.stat().st_size
            path.unlink()
        except OSError:
            continue
    return freed


STAGING_PREFIX = "gpusnap-restore-"


def staging(folder: Path, nbytes: int, key: str, staging_dir: str, log) -> Path:
    """Where a chunk image is unpacked for CRIU: a new root-only folder in
    ``staging_dir`` (``restore_staging_dir``) when it has room, else the checkpoint folder."""
    margin = 256 << 20
    if staging_dir and os.path.isdir(staging_dir):
        try:
            if shutil.disk_usage(staging_dir).free >= nbytes + margin:
                return Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=staging_dir))
        except OSError as e:
            log.warning("%s: cannot use %s for the restore (%s)", key, staging_dir, e)
    free = shutil.disk_usage(folder).free
    if free < nbytes:
        raise CheckpointError(
            f"{key}: {free / 2**30:.1f} GiB free in {folder}, the image needs "
            f"{nbytes / 2**30:.1f} GiB unpacked: free disk space (or memory in "
            f"LocalBackend.restore_staging_dir = {staging_dir!r}) and spawn again"
        )
    return folder


def stream_dir(staging_dir: str, log) -> Path:
    """A new root-only folder for CRIU's streamer socket and log: in ``staging_dir``
    (``restore_staging_dir``), else /tmp (a socket's path must stay under 108 bytes)."""
    room = 107 - len(f"/{STAGING_PREFIX}12345678/{STREAMER_SOCKET}")
    for where in (staging_dir, tempfile.gettempdir()):
        if where and os.path.isdir(where) and len(os.path.abspath(where)) <= room:
            try:
                return Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=where))
            except OSError as e:
                log.warning("cannot use %s for a restore's streamer socket (%s)", where, e)
    raise CheckpointError(
        "no folder for CRIU's streamer socket: set LocalBackend.restore_staging_dir to a short, "
        "writable path (e.g. /dev/shm) or LocalBackend.restore_streaming = False"
    )


def unstage(folder: Path, images: Path) -> None:
    """Remove unpacked image files; keep CRIU's restore log in the checkpoint folder."""
    if images == folder:
        drop_image_files(folder)
        return
    for log in images.glob("restore-*.log"):
        with contextlib.suppress(OSError):
            shutil.copyfile(log, folder / log.name)
    shutil.rmtree(images, ignore_errors=True)


def clear_staging(staging_dir: str, log, older_than: float = 3600.0) -> None:
    """Remove unpacked images a crashed restore left in ``staging_dir`` (they hold users'
    memory); only those untouched for ``older_than`` s (a restore may be running)."""
    staging = Path(staging_dir) if staging_dir else None
    if staging is None or not staging.is_dir():
        return
    now = time.time()
    for left in staging.glob(STAGING_PREFIX + "*"):
        with contextlib.suppress(OSError):
            if now - left.stat().st_mtime > older_than:
                shutil.rmtree(left)
                log.warning("removed %s, left by an interrupted restore", left)


@dataclass
class RestoreJob:
    """One restore of a checked, ``verified`` checkpoint, as its steps need it."""

    info: CheckpointInfo
    folder: Path
    manifest: Manifest
    key: str
    started: float  # time.time() when the restore began
    timeout: float

    def damaged(self, problems: list[str]) -> CheckpointError:
        return CheckpointError(
            f"{self.key}: image {self.info.id} is damaged: " + "; ".join(problems[:5])
        )


@dataclass
class ImageSource:
    """Where CRIU reads a restore's image from, and how its pages are checked.

    ``check_pages()`` starts (once) the check of what CRIU read and returns its future:
    the problems found (empty: intact). ``streamer`` is set when CRIU reads through it.
    ``read_file_pages()`` (blocking) reads ahead the library pages CRIU will write into
    (``LocalBackend.file_pages_ahead``) and returns the bytes asked for: from the image
    files in ``images``, unless the image comes through the streamer.
    """

    images: Path
    check_pages: Callable[[], asyncio.Future]
    streamer: ChunkStreamer | None = None
    read_file_pages: Callable[[], int] | None = None

    def file_pages(self) -> int:
        if self.read_file_pages is not None:
            return self.read_file_pages()
        return read_ahead_image(self.images)


class ImageStore:
    """Keeps a local checkpoint's image (see the module docstring)."""

    name = ""

    def __init__(self, backend: LocalBackend):
        self.backend = backend

    async def begin(self, folder: Path) -> Follower | None:
        """Before CRIU writes into ``folder``: what follows its writing, if anything."""
        return None

    def writeback(self, folder: Path) -> contextlib.AbstractContextManager:
        """A context around the dump (the files store flushes pages as CRIU writes)."""
        return contextlib.nullcontext()

    async def seal(self, folder: Path, m: Manifest, follower: Follower | None = None) -> None:
        """Make a complete dump durable and checksummed; fill ``files``, ``sizes``,
        ``chunk_bytes``, ``image_bytes`` and ``verification`` of ``m``. Raises
        :class:`CheckpointError` when the image cannot be made so."""
        raise NotImplementedError

    def after_verified(self, folder: Path) -> None:
        """Once the checkpoint is verified and its processes are ended."""

    def restore_source(self, job: RestoreJob) -> contextlib.AbstractAsyncContextManager:
        """An async context giving the :class:`ImageSource` of ``job``; what it made for
        CRIU (unpacked files, a streamer) is gone when it exits. Raises the job's
        ``damaged`` error when the image is found damaged before CRIU runs."""
        raise NotImplementedError


class FilesStore(ImageStore):
    """CRIU's files in the checkpoint's folder, checksummed in the manifest."""

    name = "files"

    def writeback(self, folder: Path) -> contextlib.AbstractContextManager:
        if self.backend.writeback_during_dump:
            return Writeback(folder)
        return contextlib.nullcontext()

    async def seal(self, folder: Path, m: Manifest, follower: Follower | None = None) -> None:
        b = self.backend
        chunk = max(0, b.chunk_bytes)
        m.files, m.sizes, m.image_bytes = await asyncio.to_thread(seal_image, folder, b.pool, chunk)
        m.chunk_bytes = chunk
        m.verification = "page-cache"
        if b.verify_read_back:
            await asyncio.to_thread(drop_cached, folder)
            problems = await asyncio.to_thread(
                verify_image, folder, m.files, chunk_bytes=chunk, sizes=m.sizes, pool=b.pool
            )
            if problems:
                raise CheckpointError("image verification failed: " + "; ".join(problems[:5]))
            m.verification = "read-back"

    @contextlib.asynccontextmanager
    async def restore_source(self, job: RestoreJob) -> AsyncIterator[ImageSource]:
        m, folder, pool = job.manifest, job.folder, self.backend.pool

        def check(names):
            return verify_image(
                folder, m.files, chunk_bytes=m.chunk_bytes, sizes=m.sizes, names=names, pool=pool
            )

        small = [n for n in m.files if not is_pages_file(n)]
        pages = [n for n in m.files if is_pages_file(n)]
        problems = await asyncio.to_thread(check, small)
        if problems:
            raise job.damaged(problems)

        def check_pages() -> asyncio.Future:
            """Checksums of the pages files, hashed from the page cache CRIU just filled
            (started after CRIU: hashing during it halved CRIU's read speed from the disk)."""
            if not pages:
                return asyncio.ensure_future(asyncio.sleep(0, []))
            return asyncio.ensure_future(asyncio.to_thread(check, pages))

        yield ImageSource(folder, check_pages)


class ChunksStore(ImageStore):
    """The image as chunks in the shared chunk store under checkpoint_dir."""

    name = "chunks"

    def __init__(self, backend: LocalBackend):
        super().__init__(backend)
        self._pipe_noted = False

    def store_or_fail(self) -> ChunkStore:
        """The chunk store to write to (a bad key file fails the checkpoint)."""
        try:
            return self.backend.chunk_store()
        except KeyFileError as e:
            raise CheckpointError(str(e)) from e

    def store_for(self, m: Manifest, key: str, cid: str) -> ChunkStore:
        """The chunk store with the key ``m``'s chunks are sealed with, or refuse: a missing
        key (or key file) is the admin's to put back, and the snapshot stays restorable."""
        try:
            store = self.backend.chunk_store()
            store.require_key(m.key_id)
        except (KeyFileError, ValueError) as e:
            raise CheckpointRefused(
                f"{key}: cannot restore {cid} now: {e}. The snapshot is kept; once the key is "
                "back in LocalBackend.encryption_key_file the next start restores it"
            ) from e
        return store

    async def begin(self, folder: Path) -> Follower | None:
        """Pack while CRIU writes (chunks.Follower)."""
        return await asyncio.to_thread(self.store_or_fail().follow, folder)

    async def seal(self, folder: Path, m: Manifest, follower: Follower | None = None) -> None:
        """Store the dump in ``folder`` as chunks (durable, checked) and record them in ``m``;
        ``follower`` has packed part of it while CRIU was writing."""
        if follower is not None:
            store = follower.store
            packed = await asyncio.to_thread(follower.finish, image_files(folder))
        else:
            store = self.store_or_fail()
            packed = await asyncio.to_thread(store.pack, image_files(folder))
        m.storage, m.key_id = "chunks", store.space
        m.chunks = {n: p.chunks for n, p in packed.items()}
        m.files = {n: p.digest for n, p in packed.items()}
        m.sizes = {n: p.size for n, p in packed.items()}
        m.image_bytes = sum(m.sizes.values())
        m.new_bytes = sum(p.new_bytes for p in packed.values())
        m.stored_bytes = sum(p.stored_bytes for p in packed.values())
        m.chunk_bytes = 0
        m.verification = "page-cache"
        if self.backend.verify_read_back:
            await asyncio.to_thread(store.drop_cached, m.key_id, m.chunks)
            problems = await asyncio.to_thread(store.check, m.key_id, m.chunks)
            if problems:
                raise CheckpointError("image verification failed: " + "; ".join(problems[:5]))
            m.verification = "read-back"

    def note_small_pipe(self, streamer: ChunkStreamer) -> None:
        """Once per process: streamed restores get a smaller pipe than asked for."""
        if 0 < streamer.pipe_got < streamer.pipe_bytes and not self._pipe_noted:
            self._pipe_noted = True
            self.backend.log.info(
                "Streamed restores get a %d KiB pipe, not the %d KiB of "
                "LocalBackend.restore_pipe_bytes: this process may not exceed "
                "/proc/sys/fs/pipe-max-size. Raise it on this machine (sysctl -w "
                "fs.pipe-max-size=%d) for faster streamed restores, or set restore_pipe_bytes to %d.",
                streamer.pipe_got >> 10, streamer.pipe_bytes >> 10, streamer.pipe_bytes,
                streamer.pipe_got,
            )  # fmt: skip

    def after_verified(self, folder: Path) -> None:
        """CRIU's raw files are the server's memory, unencrypted: gone once packed."""
        drop_image_files(folder)

    @contextlib.asynccontextmanager
    async def restore_source(self, job: RestoreJob) -> AsyncIterator[ImageSource]:
        b, m, folder, key = self.backend, job.manifest, job.folder, job.key
        store = self.store_for(m, key, job.info.id)
        if b.restore_streaming:
            # CRIU reads the image from the streamer, which checks every chunk before CRIU
            # gets its bytes; the tree is handed out only if the streamer found nothing wrong.
            images = stream_dir(b.restore_staging_dir, b.log)
            threads = b.hash_threads or os.cpu_count() or 1
            streamer = ChunkStreamer(
                store, m.key_id, m.chunks, images, window=4 * threads, prefetch=16 * threads,
                pipe_bytes=b.restore_pipe_bytes,
            )  # fmt: skip
            try:
                streamer.start()
            except OSError as e:
                unstage(folder, images)
                raise CheckpointError(
                    f"{key}: cannot start the image streamer in {images}: {e}"
                ) from e
            problems_after = None

            def read_file_pages() -> int:
                """The image files that place those pages, unpacked (checked) beside the
                streamer's socket: CRIU gets the image through the streamer."""
                where = images / "file-pages"
                maps = {n: refs for n, refs in m.chunks.items() if is_map_file(n)}
                try:
                    where.mkdir(mode=0o700)
                    if store.unpack(m.key_id, maps, m.sizes, where):
                        return 0  # damaged: the streamer finds it and says so
                except OSError:  # the restore ended and its folder went meanwhile
                    return 0
                return read_ahead_image(where)

            def check_pages() -> asyncio.Future:
                nonlocal problems_after
                if problems_after is None:
                    problems_after = asyncio.ensure_future(asyncio.to_thread(streamer.finish))
                return problems_after

            try:
                yield ImageSource(images, check_pages, streamer, read_file_pages)
            finally:
                await check_pages()  # the senders have stopped before the folder goes
                unstage(folder, images)
            return
        # Every chunk is checked against its id while it is unpacked: nothing runs from
        # a damaged image. The unpacked files only feed CRIU and go afterwards.
        images = staging(folder, m.image_bytes, key, b.restore_staging_dir, b.log)
        try:
            problems = await asyncio.to_thread(store.unpack, m.key_id, m.chunks, m.sizes, images)
        except BaseException:
            unstage(folder, images)
            raise
        if problems:
            unstage(folder, images)
            raise job.damaged(problems)
        try:
            yield ImageSource(images, lambda: asyncio.ensure_future(asyncio.sleep(0, [])))
        finally:
            unstage(folder, images)

    # -- housekeeping of the shared store ------------------------------------------------
    async def sweep(self) -> tuple[int, int]:
        """Delete chunks no checkpoint uses any more; (count, bytes). Skipped (0, 0) while
        a checkpoint is being written (by this process or, through the store's lock and the
        ``writing`` manifests, any other) or any checkpoint folder cannot be read: a chunk is
        only deleted when it is certainly unused."""
        b = self.backend
        if not (b.root / STORE).is_dir() or b._active:
            return 0, 0
        count, freed = await asyncio.to_thread(b.chunk_store().sweep, self._referenced)
        if count:
            b.log.info("deleted %d unused chunks (%.1f MiB)", count, freed / 2**20)
        return count, freed

    async def scrub(self, found: list, full: bool | None = None) -> dict:
        """Check the chunk store and keep shared chunks twice (see :mod:`.scrub`); the
        report as a dict (empty when there is no chunk store). ``found``: (id, folder,
        manifest, kept for rescue) of every checkpoint.

        Each call makes the replicas that chunks shared by ``replicate_min_servers`` servers
        lack; a full pass (every chunk and replica re-read, at most
        ``scrub_bytes_per_second``) runs when ``full`` is True, or when None and
        ``scrub_interval`` has passed since the last one ended. Long: run it as a task of its
        own, not in a loop that must stay on time.
        """
        b = self.backend
        if not (b.root / STORE).is_dir():
            return {}
        try:
            store = b.chunk_store()
        except KeyFileError as e:
            b.log.error("chunk scrub skipped: %s", e)
            return {}
        if full is None:
            last = chunk_scrub.load_state(store).get("last_full_end")
            full = b.scrub_interval > 0 and (
                not isinstance(last, (int, float)) or time.time() - last >= b.scrub_interval
            )
        report = await chunk_scrub.scrub(
            store, found, full=bool(full), min_servers=b.replicate_min_servers,
            bytes_per_second=b.scrub_bytes_per_second, log=b.log,
        )  # fmt: skip
        return report.as_dict()

    def _referenced(self) -> set[tuple[str, str]] | None:
        """The (space, chunk id) pairs checkpoints list; None when that cannot be known."""
        referenced: set[tuple[str, str]] = set()
        for sdir in self._server_dirs():
            for folder in sdir.iterdir():
                if not folder.is_dir():
                    continue
                try:
                    m = Manifest.load(folder)
                except (OSError, ValueError, TypeError) as e:
                    self.backend.log.warning(
                        "chunk sweep skipped: checkpoint folder %s has no readable manifest (%s); "
                        "recover or remove it by hand (docs/operations.md)", folder, e,
                    )  # fmt: skip
                    return None
                if m.status == "writing":
                    return None
                for refs in m.chunks.values():
                    referenced.update((m.key_id, cid) for cid, _ in refs)
        return referenced

    def _server_dirs(self):
        root = self.backend.root
        if not root.is_dir():
            return
        for udir in sorted(p for p in root.iterdir() if not p.name.startswith(".")):
            if udir.is_dir():
                yield from (s for s in sorted(udir.iterdir()) if s.is_dir())
