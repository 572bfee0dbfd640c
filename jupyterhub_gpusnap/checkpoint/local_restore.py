"""The restore side of :class:`~.local.LocalBackend`: a verified checkpoint back on this
host (``criu restore`` while the page files' checksums are computed, then its GPU memory),
a server an interrupted restore left running adopted instead of restored twice, and the
wait for the suspended server's old processes and port. The lazy restore is
:mod:`.local_lazy`. :class:`~.local.LocalBackend` supplies the traits and state these use
(``criu_path``, ``restore_mode``, ``restored``, ``pool``, ``image_store`` ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

from .. import sandbox
from ..gpu.compat import gpu_mismatch
from ..model import server_key
from ..procs import boot_clock, is_alive, listen_address, port_holder, started_since, tree_pids
from . import criu
from .base import CheckpointError, CheckpointInfo, CheckpointRefused, Restored, RestoreTarget
from .image_store import ImageSource, RestoreJob
from .manifest import Manifest, verify_image


class LocalRestoreMixin:
    """Restoring a checkpoint of :class:`~.local.LocalBackend` on this host."""

    async def restore(
        self, info: CheckpointInfo, timeout: float = 600.0, into: RestoreTarget | None = None
    ) -> Restored:
        """Restore a verified checkpoint on this host (``into`` is not used: a local
        checkpoint comes back where it was taken); the running server's pid, ip and port.

        Checks sizes and the small files' checksums first, then runs CRIU while the
        ``pages-*.img`` checksums are computed (see :mod:`.local`'s docstring). On any failure
        raises :class:`CheckpointError` with nothing left running (the caller marks the
        checkpoint failed and starts afresh). On success the checkpoint is marked
        ``restored``.

        With ``restore_mode = "lazy"`` the tree runs before its memory is back (every page
        checked as it arrives, :meth:`_restore_lazily`); a damaged page found after that
        kills the tree and marks the checkpoint failed (docs/lazy-restore.md).
        """
        pid, ip, port = await self._restore(info, timeout)
        return Restored(pid=pid, ip=ip, port=port)

    async def _restore(self, info: CheckpointInfo, timeout: float) -> tuple[int, str, int]:
        restore_started = time.time()
        folder = Path(info.location) if info.location else self.folder(info.id)
        m = Manifest.load(folder)
        key = server_key(m.user, m.server)
        if m.status != "verified":
            raise CheckpointError(f"{key}: checkpoint {info.id} is {m.status}, not verified")
        adopted = await self._adopt(folder, m, key, info.id)
        if adopted is not None:
            return adopted
        await self._require_criu()
        await self._wait_for_old_server(m, key)
        if m.cuda_pids and self.cuda() is not None:
            try:
                here = await asyncio.to_thread(self.cuda().gpu_inventory)
            except Exception as e:
                here = {"error": str(e)}
            why = gpu_mismatch(m, here)
            if why:
                raise CheckpointError(f"{key}: checkpoint {info.id} cannot be restored here: {why}")

        if self.restores_lazily(m):
            done = await self._restore_lazily(info, folder, m, key, restore_started, timeout)
            if done is not None:
                return done

        job = RestoreJob(info, folder, m, key, restore_started, timeout)
        async with self.image_store(m.storage).restore_source(job) as source:
            return await self._restore_tree(job, source)

    async def _adopt(
        self, folder: Path, m: Manifest, key: str, cid: str
    ) -> tuple[int, str, int] | None:
        """The server an interrupted restore of this checkpoint left running, if any.

        A restore whose caller died (the Hub killed after CRIU started) leaves CRIU to finish
        on its own: the tree runs, nobody knows it, and restoring again would clash with it.
        If ``restore.pid`` names a live process started since that restore began (both on
        the kernel's boot clock, exact to a clock tick) and listening on the checkpoint's
        port, it is that server: it is checked like any restore (every checksum; its GPU
        memory resumed) and handed out instead of a second copy.
        """
        pid = criu.read_pidfile(folder / "restore.pid")
        if not pid or not is_alive(pid):
            return None
        if started_since(pid, m.extra.get("restore_started")) is not True:
            return None  # the pid was reused by something older, or by another boot
        if listen_address(pid)[1] != m.port:
            return None
        self.log.warning(
            "%s: adopting pid %s, left running by an interrupted restore of %s", key, pid, cid
        )
        problems = []
        if m.storage == "files":
            problems = await asyncio.to_thread(
                verify_image,
                folder,
                m.files,
                chunk_bytes=m.chunk_bytes,
                sizes=m.sizes,
                pool=self.pool,
            )
        try:
            if problems:
                raise CheckpointError(f"{key}: image {cid} is damaged: " + "; ".join(problems[:5]))
            if m.cuda_pids and self.cuda() is not None:
                await self.cuda().resume(tree_pids(pid))
        except BaseException:
            await self.kill_tree(tree_pids(pid))
            raise
        m.status = "restored"
        m.restored_at = time.time()
        m.extra["restored_pid"] = pid
        m.extra["adopted"] = True
        m.save(folder)
        return pid, m.ip, m.port

    async def _wait_for_old_server(self, m: Manifest, key: str) -> None:
        """Wait until the suspended server's old processes are gone and its port is free
        (at most ``port_wait_timeout``); else refuse, the checkpoint left verified."""
        deadline = time.monotonic() + self.port_wait_timeout
        stamp = m.extra.get("started")
        while True:
            old = [
                p for p in (m.extra.get("tree") or [])
                if is_alive(p) and started_since(p, stamp) is False
            ]  # fmt: skip
            holder = port_holder(m.ip, m.port) if m.port else None
            if not old and holder is None:
                return
            if time.monotonic() > deadline:
                what = (
                    f"port {m.port}, which the suspended server listens on, is taken by {holder}"
                    if holder
                    else f"its old processes {old} are still exiting"
                )
                raise CheckpointRefused(
                    f"{key}: cannot restore yet: {what} after {self.port_wait_timeout:g}s. The "
                    "snapshot is kept; stop that process (or wait) and start the server again"
                )
            await asyncio.sleep(0.1)

    async def _restore_tree(self, job: RestoreJob, source: ImageSource) -> tuple[int, str, int]:
        """criu restore (from ``source.images``; through its streamer's socket when it has
        one) + GPU restore of a checked image (the second half of :meth:`restore`)."""
        info, folder, m, key = job.info, job.folder, job.manifest, job.key
        check_pages, damaged, streamer = source.check_pages, job.damaged, source.streamer
        phases = {"prepare_s": round(time.time() - job.started, 3)}
        m.extra["restore_started"] = boot_clock()  # what _adopt recognises this restore by
        m.save(folder)
        t = time.monotonic()
        # the library pages CRIU will write into, read meanwhile (file_pages_ahead)
        ahead = (
            asyncio.ensure_future(asyncio.to_thread(source.file_pages))
            if self.file_pages_ahead
            else None
        )
        try:
            with self._mounts_stood_in(m, key):
                restored = await criu.restore(
                    source.images,
                    folder / "restore.pid",
                    criu=self.criu_path,
                    tcp=m.tcp_mode,
                    shell_job=m.shell_job,
                    extra=[
                        *sandbox.restore_args(bool(m.extra.get("mount_namespace"))),
                        *self.restore_extra_args,
                        *(["--stream"] if streamer else []),
                    ],
                    timeout=job.timeout,
                )
        except CheckpointError as e:
            # A damaged page file is the likelier cause of a failed restore: say so.
            try:
                problems = await check_pages()
            except Exception:
                problems = []
            if problems:
                raise damaged(problems) from e
            raise
        phases["criu_s"] = round(time.monotonic() - t, 3)
        if ahead is not None:
            phases["file_pages_bytes"] = await ahead
        self.restored[restored.pid] = restored
        for p, r in list(self.restored.items()):
            if r.reap() is not None:
                self.restored.pop(p, None)
        # The page checksums (from the page cache CRIU just filled) and the GPU restore run
        # together; a damaged image still ends the restored tree before anyone sees it.
        hashing = check_pages()
        gpu = None
        if m.cuda_pids and self.cuda() is not None:
            gpu = asyncio.ensure_future(self.cuda().resume(tree_pids(restored.pid)))

        async def end(error: BaseException) -> None:
            if gpu is not None:
                await asyncio.gather(gpu, return_exceptions=True)
            await self._end_restored(restored)
            raise error

        try:
            problems = await asyncio.shield(hashing)
        except Exception as e:
            await end(CheckpointError(f"{key}: cannot check image {info.id}: {e}"))
        except BaseException as e:  # cancelled: nobody will hand this tree out
            await end(e)
        if problems:
            await end(damaged(problems))
        if streamer is not None:  # its senders have ended (check_pages waited for them)
            # which side a streamed restore waited on: the chunk store or CRIU
            phases["pipe_bytes"] = streamer.pipe_got
            phases["stream_waited_storage_s"] = round(streamer.waited["storage_s"], 3)
            phases["stream_waited_criu_s"] = round(streamer.waited["criu_s"], 3)
            self.image_store("chunks").note_small_pipe(streamer)
        phases["checks_after_criu_s"] = round(time.monotonic() - t - phases["criu_s"], 3)
        if gpu is not None:
            try:
                await gpu
            except Exception as e:
                await self.kill_tree(tree_pids(restored.pid))
                raise CheckpointError(f"{key}: restoring GPU memory failed: {e}") from e
        m.status = "restored"
        m.restored_at = time.time()
        m.extra["restored_pid"] = restored.pid
        m.extra["restore_s"] = round(m.restored_at - job.started, 3)
        # where a restore's time goes, for admins and bench/gpu_suspend.py: the GPU restore
        # runs alongside the checks, so gpu_done_s counts from the end of criu
        phases["gpu_done_s"] = round(time.monotonic() - t - phases["criu_s"], 3) if gpu else 0.0
        m.extra["restore_phases"] = phases
        m.save(folder)
        self.log.info(
            "%s: checkpoint %s restored as pid %s on %s:%s",
            key,
            info.id,
            restored.pid,
            m.ip,
            m.port,
        )
        return restored.pid, m.ip, m.port

    @contextlib.contextmanager
    def _mounts_stood_in(self, m: Manifest, key: str):
        """Around ``criu restore``: empty folders where mount points of the server's
        namespace are missing on the host (:func:`~jupyterhub_gpusnap.sandbox.stand_in`),
        removed once CRIU has bound them. The mount points stood in for are kept in
        the manifest (``mounts_stood_in``) and logged."""
        made, stood, problems = sandbox.stand_in(m.extra.get("mount_points") or [])
        if stood:
            m.extra["mounts_stood_in"] = stood
            self.log.warning(
                "%s: the host no longer has %d mount point(s) the server's namespace had at "
                "its checkpoint; an empty folder stands in for each during the restore: %s",
                key,
                len(stood),
                ", ".join(stood[:5]),
            )
        if problems:
            self.log.warning(
                "%s: cannot stand in for mount points missing on the host (the restore will "
                "fail on them; mount them on the host again): %s",
                key,
                "; ".join(problems[:5]),
            )
        try:
            yield stood
        finally:
            failed = sandbox.remove_stand_ins(made)
            if failed:
                self.log.warning(
                    "%s: cannot remove what stood in for missing mount points: %s",
                    key,
                    "; ".join(failed[:5]),
                )

    async def _end_restored(self, restored: criu.Restored) -> None:
        """Kill a restored tree that must not be handed out, and let its criu exit."""
        await self.kill_tree(tree_pids(restored.pid))
        try:
            await asyncio.wait_for(asyncio.to_thread(restored.criu.wait), self.kill_timeout)
        except asyncio.TimeoutError:
            self.log.warning(
                "criu restore (pid %s) still running after its tree was killed", restored.criu.pid
            )
        self.restored.pop(restored.pid, None)
