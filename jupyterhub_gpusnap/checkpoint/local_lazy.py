"""Lazy restore for :class:`~.local.LocalBackend` (``restore_mode = "lazy"``, or
``"auto"`` for large images; docs/lazy-restore.md): the restored tree runs before its
memory is back, each page checked as it arrives (:mod:`.lazy`); its GPU memory comes
back behind the first answer.

Here: the page checksums a lazy restore of a ``files`` checkpoint needs (written in the
background after the suspension), the restore itself, its end (every page in, or a damaged
page that kills the tree and fails the snapshot), and what :meth:`recover` resolves of a
lazy restore the Hub stopped during.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from pathlib import Path

from .. import sandbox
from ..model import server_key
from ..procs import boot_clock, is_alive, tree_pids
from . import criu, lazy
from .base import CheckpointError
from .image_store import stream_dir, unstage
from .manifest import Manifest, is_pages_file
from .page_sums import sums_name, write_sums

# A lazily restored server's GPU memory comes back within seconds of its hand-out (about
# 2 s per 8 GiB on an H100, plus its pages); one still pending this long after was left
# behind by a restoring process that stopped, and recover() brings it back.
GPU_BEHIND_GRACE = 600.0
# The driver restores GPU memory at 4.2-6.5 GiB/s on the H100 machines (8 GiB of tensors in
# 1.3-2.1 s, docs/lazy-restore.md): lazy_gpu_restore = 'overlap' starts it the time this
# rate gives before the transfer's end as estimated so far (the low end: better a little
# early, its reads then fetch what is not in yet, than after the last page).
GPU_RESTORE_BYTES_PER_S = 4 * 2**30


def gpu_restore_due(when: str, seconds_left: float | None, gpu_bytes: int) -> bool:
    """Whether a lazily restored server's GPU memory should be restored now, while its
    pages arrive (``when``: LocalBackend.lazy_gpu_restore; ``seconds_left``: until the last
    page, None while unknown). Once every page is in it is due whatever this says."""
    if when == "at_once":
        return True
    if when == "after_pages" or seconds_left is None:
        return False
    return seconds_left <= gpu_bytes / GPU_RESTORE_BYTES_PER_S


class LazyRestoreMixin:
    """The lazy restore of :class:`~.local.LocalBackend` (its traits and state: ``pool``,
    ``criu_path``, ``restored``, ``page_sums``, ``lazy_restores``)."""

    async def _write_page_sums(self, folder: Path, m: Manifest, key: str) -> bool:
        """Write the page checksums a lazy restore of a verified ``files`` checkpoint needs
        (docs/lazy-restore.md), bound to the manifest's checksums. A failure is logged and
        counted; the checkpoint stays restorable eagerly. True when all were written."""
        cid = self._id(folder)
        pages = [n for n in m.files if is_pages_file(n)]
        t = time.monotonic()
        try:
            problems = await asyncio.to_thread(
                write_sums, folder, pages, self.pool, expected=m.files, chunk_bytes=m.chunk_bytes
            )
        except Exception as e:
            problems = [f"{type(e).__name__}: {e}"]
        finally:
            self.page_sums.pop(cid, None)
        if problems:
            lazy.PAGE_SUMS_FAILED.inc()
            self.log.error(
                "%s: no page checksums for checkpoint %s (%s); it will be restored eagerly",
                key, cid, "; ".join(problems[:5]),
            )  # fmt: skip
            return False
        self.log.info("%s: page checksums of checkpoint %s written in %.2fs", key, cid,
                      time.monotonic() - t)  # fmt: skip
        return True

    def _lazy_image(self, folder: Path, m: Manifest, key: str, cid: str):
        """(what a lazy restore of ``m`` reads, '') or (None, why it must be eager)."""
        if m.storage == "chunks":
            store = self.image_store("chunks").store_for(m, key, cid)
            return lazy.ChunksImage(store, m.key_id, m.chunks, m.sizes), ""
        missing = [
            n for n in sorted(m.files) if is_pages_file(n) and not (folder / sums_name(n)).is_file()
        ]  # fmt: skip
        if missing:
            return None, (f"no page checksums for {', '.join(missing[:3])} (written in the "
                          "background after the suspension; not yet, or not for a checkpoint the "
                          "service took for an eager restore: restore_mode)")  # fmt: skip
        return lazy.FilesImage(folder, m.files, m.sizes, m.chunk_bytes), ""

    def restores_lazily(self, m: Manifest) -> bool:
        """Whether a restore of ``m`` tries the lazy path (``restore_mode``; with 'auto',
        from ``lazy_restore_min_bytes`` of image on)."""
        if self.restore_mode == "auto":
            return m.image_bytes >= self.lazy_restore_min_bytes
        return self.restore_mode == "lazy"

    async def _restore_lazily(
        self, info, folder: Path, m: Manifest, key: str, restore_started: float, timeout: float
    ) -> tuple[int, str, int] | None:
        """restore_mode = 'lazy': run the tree now, its memory following (lazy.py); None when
        it must be restored eagerly instead (logged; nothing was started)."""
        lacking = criu.lazy_patches_lacking(self.criu_path)
        if lacking:
            image, why = None, (f"{lacking} (without them a process that moves memory while "
                                "its pages arrive can read wrong pages): install CRIU with "
                                ".ci/install-criu.sh")  # fmt: skip
        else:
            image, why = self._lazy_image(folder, m, key, info.id)
        images = None
        if image is not None:
            try:
                images = stream_dir(self.restore_staging_dir, self.log)
            except CheckpointError as e:
                why = str(e)
        if images is None:
            lazy.LAZY_RESTORES.labels(result="eager").inc()
            self.log.warning("%s: restoring checkpoint %s eagerly: %s", key, info.id, why)
            return None
        phases = {"mode": "lazy", "prepare_s": round(time.time() - restore_started, 3)}
        m.extra["restore_started"] = boot_clock()  # what _adopt recognises this restore by
        m.save(folder)
        t = time.monotonic()
        try:
            with self._mounts_stood_in(m, key):
                lr = await lazy.restore(
                    image, images, folder / "restore.pid", pool=self.pool,
                    criu_path=self.criu_path, tcp=m.tcp_mode, shell_job=m.shell_job,
                    extra=[*sandbox.restore_args(bool(m.extra.get("mount_namespace"))),
                           *self.restore_extra_args],
                    timeout=timeout, copiers=self.lazy_copiers,
                    shared_bytes=self.lazy_shared_mib << 20,
                    file_pages_ahead=self.file_pages_ahead,
                )  # fmt: skip
        except CheckpointError as e:
            # nothing runs: the eager restore checks the whole image and decides, as always
            unstage(folder, images)
            lazy.LAZY_RESTORES.labels(result="eager").inc()
            self.log.warning(
                "%s: checkpoint %s cannot be restored lazily, restoring it eagerly: %s",
                key, info.id, e,
            )  # fmt: skip
            return None
        except BaseException:
            unstage(folder, images)
            raise
        restored = lr.restored
        phases["criu_s"] = round(time.monotonic() - t, 3)
        phases.update(lazy_staged_s=lr.stats["staged_s"], lazy_staging=lr.stats["staging"],
                      lazy_running_s=lr.stats["running_s"],
                      lazy_bytes=lr.lazy_bytes, lazy_eager_bytes=lr.stats["eager_bytes"],
                      lazy_shared_bytes=lr.stats["shared_bytes"])  # fmt: skip
        if self.lazy_shared_mib and not lr.stats["shared_bytes"]:
            self.log.warning(
                "%s: the pages of checkpoint %s come through the socket, not %d MiB of shared "
                "memory (LocalBackend.lazy_shared_mib): CRIU lacks patch 0012, or no memfd "
                "could be made here", key, info.id, self.lazy_shared_mib,
            )  # fmt: skip
        self.restored[restored.pid] = restored
        for p, r in list(self.restored.items()):
            if r.reap() is not None:
                self.restored.pop(p, None)
        # GPU memory comes back behind the first answer (docs/lazy-restore.md, "GPU"): the
        # processes stay in the driver's checkpointed state, where a CUDA call waits, until
        # _finish_lazy has restored and unlocked them; a cell that needs no GPU runs at once.
        gpu_pids = tree_pids(restored.pid) if m.cuda_pids and self.cuda() is not None else []
        try:
            m.status = "restored"
            m.restored_at = time.time()
            m.extra["restored_pid"] = restored.pid
            m.extra["restore_s"] = round(m.restored_at - restore_started, 3)
            m.extra["restore_phases"] = phases
            m.extra["lazy_pending"] = True  # until every page is in (recover() reads it)
            if gpu_pids:
                m.extra["gpu_pending"] = True  # until the GPU memory is back
            m.save(folder)
        except BaseException:
            await lr.abort()
            self.restored.pop(restored.pid, None)
            await self._unstage_lazy(folder, images)
            raise
        task = asyncio.ensure_future(
            self._finish_lazy(info.id, folder, key, lr, images, gpu_pids, restore_started,
                              m.gpu_bytes)
        )  # fmt: skip
        self.lazy_restores[info.id] = task
        self.log.info(
            "%s: checkpoint %s restored lazily as pid %s on %s:%s (running after %.2fs, "
            "%.1f MiB of memory to follow, %.1f MiB restored with the tree%s)",
            key, info.id, restored.pid, m.ip, m.port, lr.stats["running_s"], lr.lazy_bytes / 2**20,
            lr.stats["eager_bytes"] / 2**20,
            f", GPU memory of pids {gpu_pids} restoring behind it" if gpu_pids else "",
        )  # fmt: skip
        return restored.pid, m.ip, m.port

    async def _unstage_lazy(self, folder: Path, images: Path) -> None:
        """Keep the daemon's and the page server's logs in the checkpoint's folder (each
        whole or not at all), clear the staging folder."""
        for log in (lazy.LAZY_LOG, lazy.PAGE_SERVER_LOG):
            with contextlib.suppress(OSError):
                shutil.copyfile(images / log, folder / f"{log}.part")
                os.replace(folder / f"{log}.part", folder / log)
        await asyncio.to_thread(unstage, folder, images)

    async def _finish_lazy(
        self, cid: str, folder: Path, key: str, lr, images: Path,
        gpu_pids: list[int] | None = None, restore_started: float | None = None,
        gpu_bytes: int = 0,
    ) -> None:  # fmt: skip
        """Wait for a lazy restore's last page and, for a GPU server, restore its GPU
        memory when lazy_gpu_restore says (while the last pages arrive, after them, or at
        once; the driver's reads fault in what is not there yet, docs/lazy-restore.md
        "GPU"); record the figures. If either fails the tree is killed (it must not run on
        memory that is not its own, or on without its GPU memory) and the snapshot is
        marked failed with the reason, logged and counted."""
        gpu = None
        if gpu_pids:
            gpu = asyncio.ensure_future(self._gpu_when_due(key, cid, gpu_pids, lr, gpu_bytes))
        try:
            try:
                # the first to end: the last page (or a failed one), or the driver
                await asyncio.wait([lr.done, *([gpu] if gpu else [])],
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                page_failed = lr.done.done() and (
                    lr.done.cancelled() or lr.done.exception() is not None
                )
                if not page_failed and gpu is not None and gpu.done() and gpu.exception():
                    await self.kill_tree(tree_pids(lr.pid))
                    await asyncio.gather(lr.done, return_exceptions=True)
                    raise gpu.exception()
                stats = await lr.done
                # every page is in: recover() must now see only the GPU memory pending
                self._record_lazy(folder, key, cid, "lazy_pending", {
                    "lazy_all_in_s": stats.get("all_in_s"),
                    "lazy_served_bytes": stats.get("served_bytes"),
                    "lazy_requests": stats.get("requests"),
                    "lazy_fault_requests": stats.get("fault_requests"),
                    # where the page server's sender waited: what held the transfer back
                    **{f"lazy_{k}": stats.get(k) for k in (
                        "background_requests", "background_from_memory", "zero_bytes",
                        "zero_pages_bytes", "put_s",
                        "background_answer_p50_ms", "background_answer_p90_ms", "read_wait_s",
                        "send_wait_s", "idle_wait_s")},
                    **({} if gpu else _full(restore_started)),
                })  # fmt: skip
                if gpu is not None:
                    try:
                        gpu_started_s, gpu_done_s = await gpu
                    except CheckpointError:
                        await self.kill_tree(tree_pids(lr.pid))
                        raise
                    # every byte back: recorded now, not after the staging folder is cleared
                    self._record_lazy(folder, key, cid, "gpu_pending", {
                        "gpu_behind_s": gpu_done_s, "gpu_started_s": gpu_started_s,
                        **_full(restore_started),
                    })  # fmt: skip
            finally:
                if gpu is not None:  # a page failed (the tree is gone) or the service stops
                    gpu.cancel()
                    await asyncio.gather(gpu, return_exceptions=True)
                self.lazy_restores.pop(cid, None)
                await self._unstage_lazy(folder, images)
        except CheckpointError as e:
            lazy.LAZY_RESTORES.labels(result="failed").inc()
            self.restored.pop(lr.pid, None)
            why = _after_it_ran(e)
            self.log.error("%s: checkpoint %s: %s", key, cid, why)
            try:
                await self.mark(cid, "failed", why)
            except Exception as e2:
                self.log.error("%s: cannot mark checkpoint %s failed: %s", key, cid, e2)
            return
        except Exception as e:  # not expected: say so, the tree's fate is lazy.py's
            self.log.error("%s: lazy restore of checkpoint %s ended with %r", key, cid, e)
            return
        lazy.LAZY_RESTORES.labels(result="ok").inc()
        self.log.info(
            "%s: checkpoint %s: every page back after %.2fs (%.1f MiB served, %d requests)%s",
            key, cid, stats.get("all_in_s", 0), stats.get("served_bytes", 0) / 2**20,
            stats.get("requests", 0),
            f", GPU memory restored in {gpu_done_s:.2f}s from {gpu_started_s:.2f}s"
            if gpu is not None else "",
        )  # fmt: skip

    def _record_lazy(self, folder: Path, key: str, cid: str, done: str, phases: dict) -> None:
        """Record figures of a lazy restore in its snapshot's restore_phases and drop the
        ``done`` mark (``lazy_pending``, ``gpu_pending``)."""
        try:
            m = Manifest.load(folder)
            m.extra["restore_phases"] = {**(m.extra.get("restore_phases") or {}), **phases}
            m.extra.pop(done, None)
            m.save(folder)
        except (OSError, ValueError) as e:
            self.log.warning("%s: cannot record the lazy restore of %s: %s", key, cid, e)

    async def _gpu_when_due(
        self, key: str, cid: str, pids: list[int], lr, gpu_bytes: int
    ) -> tuple[float, float]:
        """Restore the GPU memory of a lazily restored tree once :func:`gpu_restore_due`
        says or every page is in; (seconds from the restore call to the driver's start,
        seconds the driver took). Raises CheckpointError naming what failed."""
        while not lr.done.done() and not gpu_restore_due(
            self.lazy_gpu_restore, lr.seconds_left(), gpu_bytes
        ):
            await asyncio.wait([lr.done], timeout=0.05)
        if lr.done.done() and (lr.done.cancelled() or lr.done.exception() is not None):
            raise CheckpointError("the pages did not all come; no GPU memory restored")
        started = round(time.monotonic() - lr.started, 3)
        return started, await self._restore_gpu_behind(key, cid, pids)

    async def _restore_gpu_behind(self, key: str, cid: str, pids: list[int]) -> float:
        """Restore and unlock the GPU memory of a lazily restored tree while it runs; the
        seconds it took. Raises CheckpointError naming what failed."""
        t = time.monotonic()
        try:
            await self.cuda().resume(pids)
        except Exception as e:
            raise CheckpointError(f"restoring GPU memory of pids {pids} failed: {e}") from e
        took = round(time.monotonic() - t, 3)
        self.log.info("%s: checkpoint %s: GPU memory back after %.2fs", key, cid, took)
        return took

    async def _recover_gpu_behind(self, folder: Path, m: Manifest) -> None:
        """A lazy restore whose pages all came but whose GPU memory the restoring process
        (the Hub) did not bring back before it stopped: the server runs, locked out of its
        GPU (a CUDA call waits). Its GPU memory is restored here; if that fails the server
        is stopped and its snapshot marked failed (kept for rescue). Left alone while the
        restore may still be under way (GPU_BEHIND_GRACE after it was handed out)."""
        cid = self._id(folder)
        key = server_key(m.user, m.server)
        pid = m.extra.get("restored_pid")
        if cid in self.lazy_restores or time.time() - (m.restored_at or 0) < GPU_BEHIND_GRACE:
            return
        if self.cuda() is None or not pid or not is_alive(pid):
            m.extra.pop("gpu_pending", None)  # nothing left to bring back to
            m.save(folder)
            return
        try:
            await self._restore_gpu_behind(key, cid, tree_pids(pid))
        except CheckpointError as e:
            await self.kill_tree(tree_pids(pid))
            m.status, m.error = "failed", _after_it_ran(e)
            m.extra["failed_at"] = time.time()
            lazy.LAZY_RESTORES.labels(result="failed").inc()
            self.log.error("%s: checkpoint %s: %s", key, cid, m.error)
        m.extra.pop("gpu_pending", None)
        m.save(folder)

    def _recover_lazy(self, folder: Path, m: Manifest) -> None:
        """A lazy restore whose last page never came and whose server is gone: the process
        that served its memory (the Hub) stopped mid-transfer, and the guard killed the
        tree. Its snapshot is the only copy of that work: marked failed (kept
        max_age_days for rescue, docs/operations.md), not left 'restored'."""
        cid = self._id(folder)
        pid = m.extra.get("restored_pid")
        if cid in self.lazy_restores or (pid and is_alive(pid)):
            return  # under way (here, or in the Hub)
        m.status = "failed"
        m.error = (f"{lazy.UNFINISHED}: the process serving its memory (the Hub) stopped before "
                   "every page was in, and the restored server was stopped with it")  # fmt: skip
        m.extra["failed_at"] = time.time()
        m.save(folder)
        self.log.error("%s: checkpoint %s: %s", server_key(m.user, m.server), cid, m.error)


def _full(restore_started: float | None) -> dict:
    """``full_restore_s``: from the restore call until now (every page and GPU byte back)."""
    if restore_started is None:
        return {}
    return {"full_restore_s": round(time.time() - restore_started, 3)}


def _after_it_ran(error: Exception) -> str:
    """A failed snapshot's error when its lazy restore could not finish after the server
    ran; the service tells such a server's end by its start, :data:`.lazy.UNFINISHED`."""
    return f"{lazy.UNFINISHED} after the server ran: {error}"
