"""Lazy restore: the process tree first, its memory on demand, every page checked.

``criu restore --lazy-pages`` rebuilds the tree without the memory a lazy restore may
leave out (private anonymous memory: the heap, Python objects, tensors in host memory)
and hands each process's userfaultfd to ``criu lazy-pages``. The tree runs at once; a
page it touches is fetched when it is first touched, and the daemon copies the rest in
the background, in address order, until every page is in. The daemon gets its pages from
our :class:`~.page_server.PageServer`, which checks each one before it is sent: against
the chunk ids when the image is in the chunk store (read, opened and checked straight
from the store: no unpacked copy), against the page sums (:mod:`.page_sums`) when it is
kept as files.

What CRIU reads itself comes from a *staging* folder, all of it checked first: the small
image files (copied and checked against the manifest, or unpacked from their chunks) and
each pages file as a sparse file holding only the pages CRIU restores eagerly (stacks,
private file mappings, shared memory: a few MiB), read through the same checked sources.
With a CRIU that has patch 0015, the pagemaps there also mark the lazy pages whose page
sums or chunk ids say they hold zeros: the daemon maps the zero page over them instead of asking for
them (the eager pages then lie further up in the staged pages files: the pages CRIU reads
are only those it is given as stored).

Failure: a page that fails its check is never answered; the faulting thread waits in
the kernel while the whole tree is killed. The daemon dying would close the
userfaultfds, and the kernel would then give the waiting threads zero-filled pages
instead of theirs — so a guard process (:mod:`.uffd_guard`) holds duplicates of the
daemon's userfaultfds until every page is in: a dead daemon leaves the tree blocked, not
wrong, and it is killed; the service dying (its page server gone) makes the guard kill
the tree. Either way :attr:`LazyRestore.done` raises :class:`~.base.CheckpointError`
naming the page, chunk or daemon log, with the tree gone. A failure before the tree runs
raises from :func:`restore` itself, as an eager restore does. docs/lazy-restore.md has
the design and the figures.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from concurrent import futures
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from prometheus_client import Counter

from ..metrics import REGISTRY
from . import criu, uffd_guard
from .base import CheckpointError
from .chunks import ChunkStore
from .file_pages import read_ahead_image
from .manifest import is_pages_file, verify_image
from .page_server import BACKGROUND, AnswerRing, PageServer
from .page_source import ChunkPages, PageDamaged, RawPages
from .page_sums import SumsError, load_sums
from .pagemap import (
    PagemapError,
    eager_copies,
    eager_ranges,
    lazy_bytes,
    pagemap_image,
    read_pagemaps,
    with_zero_pages,
)

LAZY_LOG = "lazy-pages.log"
PAGE_SERVER_LOG = "page-server.log"  # when each request came and its answer went
# Send buffer of the page server's socket (capped by wmem_max): room for one answer of the
# background transfer (up to 4 MiB), and no more, since an answer to a page fault waits
# behind what is in it.
SOCKET_BYTES = 1 << 20
# LazyRestore.seconds_left tells the transfer's rate once this much came
RATE_AFTER = 64 << 20
# The staging reads the eager pages in pieces of at most EAGER_PIECE bytes, in the pool,
# holding at most EAGER_IN_FLIGHT bytes of them at once (a process's shared memory is all
# eager, and may be large)
EAGER_PIECE = 4 << 20
EAGER_IN_FLIGHT = 64 << 20


#: in the service's registry (/services/<name>/metrics): the service writes the sums
PAGE_SUMS_FAILED = Counter(
    "gpusnap_page_sums_failures",
    "Suspensions (storage = 'files', restored lazily: LocalBackend.restore_mode) whose page "
    "checksums could not be written; their snapshot restores eagerly.",
    registry=REGISTRY,
)
#: in the default registry: restores run in the Hub, which serves it at /hub/metrics
LAZY_RESTORES = Counter(
    "gpusnap_lazy_restores",
    "Restores tried lazily (LocalBackend.restore_mode), by result: ok (every page back), failed "
    "(the restored server was killed: a damaged page, or the page transfer ended; its snapshot "
    "is marked failed), eager (restored eagerly instead: no page checksums, a CRIU without the "
    "lazy-restore patches, or CRIU could not).",
    ["result"],
)


#: How the error of a snapshot whose lazy restore handed the server out and could not
#: finish begins (the backend stopped that server and failed the snapshot); the service
#: records such a server's end as a failed restore, not a stop.
UNFINISHED = "lazy restore failed"


class LazyUnavailable(CheckpointError):
    """This image cannot be restored lazily (no or damaged page sums), though it may well
    be intact: restore it eagerly. Nothing was started."""


# ---------------------------------------------------------------------- image sources
@dataclass
class FilesImage:
    """An image kept as files in ``folder`` (``files``/``sizes``/``chunk_bytes``: the
    manifest's). Needs the page sums :func:`.page_sums.write_sums` wrote."""

    folder: Path
    files: dict[str, str]
    sizes: dict[str, int]
    chunk_bytes: int = 0

    def names(self) -> list[str]:
        return sorted(self.files)

    def size(self, name: str) -> int:
        return self.sizes.get(name, 0)

    def stage_small(self, dest: Path, pool: Executor) -> list[str]:
        small = [n for n in self.names() if not is_pages_file(n)]
        for name in small:
            shutil.copyfile(self.folder / name, dest / name)
            os.chmod(dest / name, 0o600)
        return verify_image(dest, self.files, chunk_bytes=self.chunk_bytes, sizes=self.sizes,
                            names=small, pool=pool)  # fmt: skip

    def source(self, name: str, pool: Executor) -> RawPages:
        sums = load_sums(self.folder, name, self.sizes.get(name, -1))
        return RawPages(self.folder / name, sums, pool)


@dataclass
class ChunksImage:
    """An image kept in the chunk store (``space``, ``chunks``, ``sizes``: the manifest's)."""

    store: ChunkStore
    space: str
    chunks: dict[str, list]
    sizes: dict[str, int]

    def names(self) -> list[str]:
        return sorted(self.chunks)

    def size(self, name: str) -> int:
        return self.sizes.get(name, sum(int(n) for _, n in self.chunks[name]))

    def stage_small(self, dest: Path, pool: Executor) -> list[str]:
        small = {n: refs for n, refs in self.chunks.items() if not is_pages_file(n)}
        return self.store.unpack(self.space, small, self.sizes, dest)

    def source(self, name: str, pool: Executor) -> ChunkPages:
        return ChunkPages(self.store, self.space, name, self.chunks[name], pool)


def _sparse(path: Path, size: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def stage(
    image: FilesImage | ChunksImage,
    dest: Path,
    pool: Executor,
    times: dict | None = None,
    *,
    file_pages_ahead: bool = False,
    zero_pages: bool = False,
):
    """Write what ``criu restore --lazy-pages`` reads itself into ``dest``, all of it
    checked; return (the image's pagemaps, {pages file: source}). Raises CheckpointError
    naming what is damaged or missing. Blocking. ``file_pages_ahead``: also have the kernel
    read ahead the library pages CRIU will write into (:mod:`.file_pages`). ``zero_pages``
    (a CRIU with patch 0015): the pagemaps CRIU reads mark the lazy pages whose page sums or
    chunk ids say they hold zeros, which its daemon then maps as zero pages instead of asking
    for them (:func:`.pagemap.with_zero_pages`). ``times`` (if
    given) gets the seconds of each step: ``small_s`` (the small files, copied and checked),
    ``pagemaps_s``, ``file_pages_s`` (with ``file_pages_ahead``; ``file_pages_bytes`` how much
    was asked for), ``sources_s`` (page sums loaded, chunk lists), ``eager_s`` (the eager
    pages read, checked and written; ``eager_loaded_bytes``, what that read and checked: the
    page sums' blocks around each eager run, or whole chunks); with ``zero_pages``,
    ``zero_pages_s`` (the pagemaps CRIU reads written) and ``zero_pages_bytes``."""
    times = {} if times is None else times
    t = time.monotonic()

    def took(step: str) -> None:
        nonlocal t
        now = time.monotonic()
        times[step] = round(now - t, 3)
        t = now

    for name in image.names():  # filled with the eager pages below
        if is_pages_file(name):
            _sparse(dest / name, image.size(name))
    problems = image.stage_small(dest, pool)
    if problems:
        raise CheckpointError("image is damaged: " + "; ".join(problems[:5]))
    took("small_s")
    try:
        pagemaps = read_pagemaps(dest)
    except PagemapError as e:
        raise CheckpointError(f"image is damaged: {e}") from e
    took("pagemaps_s")
    if file_pages_ahead:
        times["file_pages_bytes"] = read_ahead_image(dest, pagemaps)
        took("file_pages_s")
    sources = {}
    try:
        for name in image.names():
            if is_pages_file(name):
                sources[name] = image.source(name, pool)
        took("sources_s")
        given = pagemaps
        if zero_pages:
            given = _with_zero_pages(dest, pagemaps, sources, times)
            took("zero_pages_s")
        eager = eager_copies(given)
        for name in eager:
            if name not in sources:
                raise CheckpointError(
                    f"image is damaged: {name}, which a pagemap names, is missing"
                )
        _write_eager(dest, eager, sources, pool)
        took("eager_s")
        times["eager_loaded_bytes"] = sum(s.loaded_bytes for s in sources.values())
    except SumsError as e:
        for s in sources.values():
            s.close()
        raise LazyUnavailable(f"image cannot be restored lazily: {e}") from e
    except PageDamaged as e:
        for s in sources.values():
            s.close()
        raise CheckpointError(f"image is damaged: {e}") from e
    except BaseException:
        for s in sources.values():
            s.close()
        raise
    return pagemaps, sources


def _write_eager(dest: Path, eager: dict, sources: dict, pool: Executor) -> None:
    """Read, check and write into ``dest``'s pages files the eager pages (``eager``:
    :func:`.pagemap.eager_copies`): read in pieces of at most ``EAGER_PIECE`` bytes in the
    pool, only the blocks that hold them (:meth:`.RawPages.read_once`), at most
    ``EAGER_IN_FLIGHT`` bytes at once, each written as it comes, in order. Raises the first
    piece's :class:`PageDamaged`, with nothing left reading."""
    pieces = []
    for name, copies in eager.items():
        for src, off, n in copies:
            while n:
                step = min(n, EAGER_PIECE - src % EAGER_PIECE)
                pieces.append((name, src, off, step))
                src, off, n = src + step, off + step, n - step
    pieces.reverse()  # taken from the end
    pending: collections.deque = collections.deque()
    fds: dict[str, int] = {}
    try:
        for name in eager:
            fds[name] = os.open(dest / name, os.O_WRONLY)
        flying = 0
        while True:
            while pieces and (not pending or flying + pieces[-1][3] <= EAGER_IN_FLIGHT):
                name, src, _, n = piece = pieces.pop()
                pending.append((piece, pool.submit(sources[name].read_once, src, n)))
                flying += n
            if not pending:
                return
            (name, _, off, n), got = pending.popleft()
            view = memoryview(got.result())
            flying -= n
            while view:
                done = os.pwrite(fds[name], view, off)
                view, off = view[done:], off + done
    finally:
        for _, got in pending:  # a piece failed: the others stop before the files close
            got.cancel()
        futures.wait([got for _, got in pending])
        for fd in fds.values():
            os.close(fd)


def _with_zero_pages(dest: Path, pagemaps, sources, times: dict) -> list:
    """The pagemaps CRIU is given, written into ``dest``, with the lazy pages known to hold
    zeros marked (their page sums or chunk ids say so: :meth:`.RawPages.zero_ranges`,
    :func:`.pagemap.with_zero_pages`). ``times["zero_pages_bytes"]``: how many bytes that is."""
    given, zeros = [], 0
    ranges = {name: source.zero_ranges() for name, source in sources.items()}
    for pm in pagemaps:
        zero = ranges.get(pm.pages_file)
        if zero:
            out, n = with_zero_pages(pm, zero)
            if n:
                path = dest / pm.name
                try:
                    path.write_bytes(pagemap_image(path.read_bytes(), out))
                except PagemapError:
                    out, n = pm, 0  # entries this cannot write again: given as it was
            pm = out
            zeros += n
        given.append(pm)
    times["zero_pages_bytes"] = zeros
    return given


# ---------------------------------------------------------------------- the restore
def _quantiles_ms(name: str, seconds: list[float]) -> dict:
    """``{name}_p50_ms`` and ``{name}_p90_ms`` of ``seconds`` (none when it is empty)."""
    if not seconds:
        return {}
    s = sorted(seconds)
    return {
        f"{name}_p{q}_ms": round(s[min(len(s) - 1, len(s) * q // 100)] * 1000, 2) for q in (50, 90)
    }


def _descendants(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def kill_restored(criu_pid: int) -> None:
    """SIGKILL every process under ``criu restore`` (the restored tree), until none is left."""
    for _ in range(50):
        pids = _descendants(criu_pid)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


@dataclass
class LazyRestore:
    """A tree restored lazily: runs now, its memory arriving (see :attr:`done`)."""

    restored: criu.Restored
    daemon: subprocess.Popen
    server: PageServer
    staging: Path
    lazy_bytes: int
    started: float
    #: time.monotonic() when the tree ran (it was handed out)
    running_at: float = 0.0
    #: resolves to the transfer's figures once every page is in; raises CheckpointError
    #: (the tree killed) if that cannot happen
    done: asyncio.Future | None = None
    stats: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.restored.pid

    def seconds_left(self) -> float | None:
        """Seconds until the last page is in, at the rate pages came since the tree ran;
        None until ``RATE_AFTER`` bytes came (too early to tell)."""
        served = self.server.bytes
        if served < RATE_AFTER:
            return None
        took = time.monotonic() - self.running_at
        return max(0, self.lazy_bytes - served) * took / served

    async def abort(self) -> None:
        """Kill the tree and the daemon now (the server is not handed out after all)."""
        if self.done is not None and not self.done.done():
            self.server._fail(CheckpointError("lazy restore called off"))
            with contextlib.suppress(CheckpointError):
                await self.done


async def restore(
    image: FilesImage | ChunksImage,
    staging: Path | str,
    pidfile: Path | str,
    *,
    pool: Executor,
    criu_path: str = "",
    tcp: str = "close",
    shell_job: bool = False,
    extra: list[str] | tuple[str, ...] = (),
    timeout: float = 600,
    poll: float = 0.05,
    copiers: int | None = None,
    shared_bytes: int = 0,
    file_pages_ahead: bool = False,
) -> LazyRestore:
    """Restore ``image`` lazily, CRIU working in ``staging`` (a new, empty, root-only
    folder the caller removes afterwards; its logs are CRIU's). Returns once the tree
    runs, with :attr:`LazyRestore.done` to await for the rest. ``pidfile``, ``tcp``,
    ``shell_job``, ``extra``, ``timeout``: as :func:`.criu.restore` takes them.
    ``copiers``: the daemon's copier threads (:func:`.criu.start_lazy_pages`).
    ``shared_bytes``: memory shared with the daemon that the pages go through instead of
    the socket (:class:`.page_server.AnswerRing`; 0: none, nor with a CRIU without patch
    0012). ``file_pages_ahead``: as :func:`stage` takes it.

    Raises :class:`CheckpointError` (nothing left running) when the image is damaged, has
    no page sums (files: restore eagerly then), or CRIU fails.
    """
    staging = Path(staging)
    t0 = time.monotonic()
    steps: dict = {}
    zero_pages = not criu.lazy_patches_missing(criu_path, criu.ZERO_PATCHES)
    pagemaps, sources = await asyncio.to_thread(
        stage, image, staging, pool, steps, file_pages_ahead=file_pages_ahead,
        zero_pages=zero_pages,
    )  # fmt: skip
    staged_s = time.monotonic() - t0
    failed = asyncio.Event()
    ring = None
    if shared_bytes and not criu.lazy_patches_missing(criu_path, criu.SHARED_PATCHES):
        with contextlib.suppress(OSError):  # no memfd here (seccomp, no memory): the socket
            ring = AnswerRing(shared_bytes)
    server = PageServer(pagemaps, sources, pool, on_failure=lambda e: failed.set(), ring=ring)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(OSError):
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BYTES)
    serving = asyncio.ensure_future(server.serve(ours))
    daemon = None
    guard = None
    restore_task = None

    def close_sources() -> None:
        for s in sources.values():
            s.close()

    async def stop_all() -> None:
        if guard is not None:  # the tree is gone or has all its memory: let go
            await asyncio.to_thread(uffd_guard.release, guard)
        if daemon is not None and daemon.poll() is None:
            daemon.kill()
        if daemon is not None:
            await asyncio.to_thread(daemon.wait)
        server.close()
        await asyncio.gather(serving, return_exceptions=True)
        close_sources()
        with contextlib.suppress(OSError):
            server.write_trace(staging / PAGE_SERVER_LOG)

    try:
        try:
            daemon = await criu.start_lazy_pages(
                staging, theirs.fileno(), criu=criu_path, log_name=LAZY_LOG, copiers=copiers,
                shared_fd=None if ring is None else ring.fd,
            )  # fmt: skip
        finally:
            theirs.close()
        guard = uffd_guard.start(daemon.pid, str(staging))
        restore_task = asyncio.ensure_future(
            criu.restore(
                staging, pidfile, criu=criu_path, tcp=tcp, shell_job=shell_job,
                extra=[*extra, "--lazy-pages"], timeout=timeout,
            )
        )  # fmt: skip
        # A page failing its check while CRIU still restores: end that restore (and what
        # it made so far) before the daemon goes.
        while not restore_task.done():
            waiter = asyncio.ensure_future(failed.wait())
            await asyncio.wait(
                [restore_task, waiter], timeout=poll, return_when=asyncio.FIRST_COMPLETED
            )
            waiter.cancel()
            if failed.is_set() and not restore_task.done():
                await asyncio.to_thread(_end_restores, staging)
        try:
            restored = restore_task.result()
        except CheckpointError as e:
            if server.failure is not None:
                raise CheckpointError(f"lazy restore failed: {server.failure}") from e
            raise CheckpointError(f"{e}\nlazy-pages log {staging / LAZY_LOG}:\n"
                                  f"{criu.log_tail(staging / LAZY_LOG)}") from e  # fmt: skip
    except BaseException:
        if restore_task is not None and not restore_task.done():
            # called off mid-restore: CRIU would finish a tree nobody serves
            restore_task.cancel()
            _end_restores(staging)
        await stop_all()
        raise
    lazy = LazyRestore(
        restored=restored, daemon=daemon, server=server, staging=staging,
        lazy_bytes=lazy_bytes(pagemaps) - steps.get("zero_pages_bytes", 0), started=t0,
        running_at=time.monotonic(),
    )  # fmt: skip
    # what CRIU restored itself: a few MiB, unless a process's memory could not be left lazy
    eager = sum(n for ranges in eager_ranges(pagemaps).values() for _, n in ranges)
    lazy.stats = {"staged_s": round(staged_s, 3), "staging": steps,
                  "running_s": round(lazy.running_at - t0, 3),
                  "lazy_bytes": lazy.lazy_bytes, "eager_bytes": eager,
                  "shared_bytes": 0 if ring is None else ring.size}  # fmt: skip
    lazy.done = asyncio.ensure_future(_watch(lazy, failed, stop_all, poll))
    return lazy


def _end_restores(staging: Path) -> None:
    """Kill the ``criu restore`` working on ``staging`` and all it restored so far."""
    for proc in _criu_restores(staging):
        kill_restored(proc)
        with contextlib.suppress(OSError):
            os.kill(proc, signal.SIGKILL)


def _criu_restores(staging: Path) -> list[int]:
    """``criu restore`` processes (children of this one) working on ``staging``."""
    out = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            cmd = child.cmdline()
            if "restore" in cmd and str(staging) in cmd:
                out.append(child.pid)
    return out


async def _watch(lazy: LazyRestore, failed: asyncio.Event, stop_all, poll: float) -> dict:
    """Until every page is in; on a failed page or a dead daemon, kill the tree first (the
    guard holds the userfaultfds meanwhile), then let go."""
    daemon, server = lazy.daemon, lazy.server
    try:
        while daemon.poll() is None and not failed.is_set():
            waiter = asyncio.ensure_future(failed.wait())
            await asyncio.wait([waiter], timeout=poll)
            waiter.cancel()
        status = daemon.poll()
        if failed.is_set() or status != 0:
            await asyncio.to_thread(kill_restored, lazy.restored.criu.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(lazy.restored.criu.wait, 30)
            if server.failure is not None:
                why = str(server.failure)
            else:
                why = (f"criu lazy-pages exited with {status} before every page was in; log "
                       f"{lazy.staging / LAZY_LOG}:\n{criu.log_tail(lazy.staging / LAZY_LOG)}")  # fmt: skip
            raise CheckpointError(f"lazy restore failed, the restored tree was killed: {why}")
        lazy.stats.update(
            all_in_s=round(time.monotonic() - lazy.started, 3),
            served_bytes=server.bytes,
            requests=server.requests,
            fault_requests=server.faults,
            read_s=round(server.read_s, 3),
            background_requests=server.asked[BACKGROUND],
            background_from_memory=server.from_memory,
            zero_bytes=sum(s.zero_bytes for s in server.sources.values()),
            zero_pages_bytes=lazy.stats["staging"].get("zero_pages_bytes", 0),
            put_s=round(server.put_s, 3),
            **_quantiles_ms("background_answer", server.background_answer_s),
            **{f"{k}_wait_s": round(v, 3) for k, v in server.waited.items()},
        )
        return lazy.stats
    except asyncio.CancelledError:
        # Nobody will serve the rest of its memory (this service is going): the tree
        # cannot be finished, and must not run on zero pages once the daemon is gone.
        if daemon.poll() != 0:
            kill_restored(lazy.restored.criu.pid)
        raise
    finally:
        await stop_all()
