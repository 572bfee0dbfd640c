"""The suspension side of :class:`~.local.LocalBackend`: the checks before a checkpoint
(CRIU, the process, the disk, with each suspension's estimate held until it ends), the hooks
of :class:`~.base.CheckpointBackend`'s protocol (``do_preflight`` to ``do_resume``: freeze
the GPU, ``criu dump --leave-stopped``, verify, record, then kill the tree — or resume it
and keep the image ``failed``), and the crash-recovery hooks (``do_unfinished``,
``do_dumped``). :class:`~.local.LocalBackend` supplies the traits and state these use
(``criu_path``, ``storage``, ``_reserved``, ``_active``, ``image_store`` ...).
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import shutil
import signal
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import psutil

from .. import sandbox
from ..model import Server, server_key
from ..procs import boot_clock, environ_of, is_alive, is_frozen, listen_address, tree_pids
from . import criu
from .base import CheckpointError, CheckpointInfo, CheckpointRefused, Suspension
from .chunks import Follower
from .image_store import drop_image_files
from .manifest import Manifest, check_complete

_TS = "%Y%m%dT%H%M%S"


@dataclass
class LocalSuspension(Suspension):
    """A local suspension: the checkpoint's folder and manifest, the tree, what was frozen."""

    folder: Path = Path()
    manifest: Manifest | None = None
    pids: list[int] = field(default_factory=list)
    cuda_pids: list[int] = field(default_factory=list)
    follower: Follower | None = None
    # found after a crash (recover): whether the server's root process runs, frozen
    root_alive: bool = True
    frozen: bool = True


class LocalSuspendMixin:
    """Suspending a server of :class:`~.local.LocalBackend` with CRIU (+ the CUDA checkpoint API)."""

    async def check(self, server: Server) -> None:
        """Refuse (:class:`CheckpointRefused`) when ``server`` cannot be checkpointed now."""
        await self._preflight(server)

    async def _preflight(
        self, server: Server, reserve: bool = False
    ) -> tuple[str, list[int], int, dict]:
        """Checks before touching anything; returns (criu version, tree pids, estimate,
        GPU inventory). Everything here runs before the GPU is freed: keep it quick.
        ``reserve``: hold the estimate of disk space for this server until
        :meth:`_locked_checkpoint` ends (other suspensions then count it as taken)."""
        version = await self._require_criu()
        pid = server.pid
        if not pid:
            raise CheckpointRefused(
                f"{server.key}: no pid in the spawner state (needs a local spawner and the "
                "admin:server_state scope)"
            )
        if not is_alive(pid):
            raise CheckpointRefused(f"{server.key}: process {pid} is not running")
        pending = self._load_all(server.user, server.name)
        if pending and pending[0][1].status == "writing":
            raise CheckpointRefused(
                f"{server.key}: a checkpoint is already being written ({self._id(pending[0][0])})",
                retry=True,
            )
        pids = tree_pids(pid)
        why = "; ".join(sandbox.unreachable_files(pids)[:3]) or criu.limits_unreadable(pids)
        if why:
            raise CheckpointRefused(f"{server.key}: cannot be checkpointed: {why}")
        rss = 0
        for p in pids:
            try:
                rss += psutil.Process(p).memory_info().rss
            except psutil.Error:
                pass
        inventory: dict = {}
        cuda = self.cuda()
        if cuda is not None:
            try:  # one NVML pass: the estimate and the manifest's GPU facts
                inventory = await asyncio.to_thread(cuda.gpu_inventory, pids)
            except Exception as e:  # no NVML: the estimate is CPU-only
                self.log.debug("GPU inventory of %s unavailable: %s", server.key, e)
        estimate = rss + int(inventory.get("gpu_bytes", 0))
        self._mkdir(self.root)
        # From here to the reservation nothing awaits: two suspensions cannot both take
        # the same free space.
        self._check_disk(server.key, estimate)
        if reserve:
            self._reserved[server.key] = estimate
        return version, pids, estimate, inventory

    async def _detach_gone_mounts(self, server: Server, pid: int, pids: list[int]) -> None:
        """Detach, inside the server's mount namespace, the mounts the host no longer has
        (:func:`~jupyterhub_gpusnap.sandbox.gone_mounts`): a restore binds every mount of
        the namespace again from the host, and fails on one that is gone. Refuses when a
        process of the server still uses one (its restore could not bring it back)."""
        gone = sandbox.gone_mounts(pid)
        if not gone:
            return
        held = sandbox.users_of(pids, gone)
        if held:
            raise CheckpointRefused(
                f"{server.key}: cannot be checkpointed: the host no longer has "
                f"{', '.join(gone[:3])}, mounted when the server started, and the server "
                f"still uses it ({'; '.join(held[:3])}); a restore could not bring it back: "
                "mount it on the host again, or let the user close what they opened there"
            )
        failed = await asyncio.to_thread(sandbox.detach_mounts, pid, gone)
        if failed:
            raise CheckpointRefused(
                f"{server.key}: cannot be checkpointed: could not detach mounts the host no "
                f"longer has ({'; '.join(failed[:3])}); a restore would fail on them"
            )
        self.log.info(
            "%s: detached %d mount(s) the host no longer has before the checkpoint: %s",
            server.key,
            len(gone),
            ", ".join(gone[:5]),
        )

    def _check_disk(self, key: str, estimate: int) -> None:
        """Refuse unless checkpoint_dir's disk holds ``estimate`` + min_free_bytes beyond
        what suspensions under way have reserved (their estimates, held until they end)."""
        free = shutil.disk_usage(self.root).free
        others = {k: n for k, n in self._reserved.items() if k != key}
        held = sum(others.values())
        need = estimate + self.min_free_bytes
        if free - held >= need:
            return
        gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
        needs = (
            f"need {gib(estimate)} for the image + {gib(self.min_free_bytes)} "
            "(LocalBackend.min_free_bytes)"
        )
        if free >= need:  # it fits once the suspensions under way are done
            raise CheckpointRefused(
                f"{key}: not enough disk in {self.root} now: {gib(free)} free, "
                f"{gib(held)} of it reserved by suspensions under way "
                f"({', '.join(sorted(others))}), {needs}. Nothing was frozen; it is tried "
                "again later. If it persists, free space, move checkpoint_dir, or lower "
                "Watcher.suspend_concurrency",
                retry=True,
            )
        raise CheckpointRefused(
            f"{key}: not enough disk in {self.root}: {gib(free)} free"
            + (f" ({gib(held)} of it reserved by suspensions under way)" if held else "")
            + f", {needs}; free space, move checkpoint_dir, or lower keep_last/max_age_days"
        )

    async def checkpoint(self, server: Server) -> CheckpointInfo:
        """Checkpoint, verify, then kill ``server``'s tree (see :mod:`.local`'s docstring).

        Cancelling the caller (e.g. ``asyncio.wait_for`` timing out) does not abort a
        checkpoint half-way, which could leave the server frozen: it runs to its end
        (verified and ended, or failed and resumed) and the outcome is logged.
        ``dump_timeout`` bounds the dump itself.
        """
        task = asyncio.ensure_future(self._locked_checkpoint(server))
        task.add_done_callback(lambda t: self._log_orphan(server.key, t))
        return await asyncio.shield(task)

    async def _locked_checkpoint(self, server: Server) -> CheckpointInfo:
        async with self._lock(server.key):
            self._active.add(server.key)
            try:
                return await super().checkpoint(server)
            finally:
                self._active.discard(server.key)
                self._reserved.pop(server.key, None)  # the dump has ended: its space is real

    def _log_orphan(self, key: str, task: asyncio.Task) -> None:
        """Retrieve the outcome of a checkpoint whose caller stopped waiting."""
        if task.cancelled():
            return
        error = task.exception()
        if error is not None and not isinstance(error, CheckpointError):
            self.log.error("%s: checkpoint crashed: %r", key, error)

    async def do_preflight(self, server: Server) -> LocalSuspension:
        """The checks (:meth:`_preflight`, its disk estimate held for this suspension),
        then the checkpoint's folder and its manifest, ``writing`` (what :meth:`recover`
        finds after a crash)."""
        t0 = time.monotonic()  # time_to_gpu_free_s counts from here
        version, pids, _, inv = await self._preflight(server, reserve=True)
        pid = server.pid
        # it changes the server's namespace: here, not in the read-only check()
        await self._detach_gone_mounts(server, pid, pids)
        created = time.time()
        stamp = datetime.fromtimestamp(created, timezone.utc).strftime(_TS)
        folder = (
            self.server_dir(server.user, server.name)
            / f"{stamp}.{int(created * 1e6) % 1_000_000:06d}Z"
        )
        self._mkdir(folder)
        m = Manifest(
            user=server.user,
            server=server.name,
            created=created,
            criu_version=version,
            pid=pid,
            tcp_mode=self.tcp_mode,
            shell_job=criu.needs_shell_job(pid),
            gpu_model=inv.get("gpu_model", ""),
            gpu_count=int(inv.get("gpu_count", 0)),
            gpu_bytes=int(inv.get("gpu_bytes", 0)),
            driver_version=inv.get("driver_version", ""),
            # the storage it is written for, from the start: a failed or interrupted chunk
            # checkpoint's raw files (plaintext memory) are then known to be deleted
            storage=self.storage,
        )
        m.extra["tree"] = pids
        m.extra["started"] = boot_clock()  # processes older than this are the suspended server
        m.extra["mount_namespace"] = sandbox.own_mount_namespace(pid)
        # what the restore binds again from the host (after the gone ones were detached)
        m.extra["mount_points"] = sandbox.mount_points(pid)
        m.extra["gpu_devices"] = list(inv.get("gpu_devices", []))
        # Not fsync'ed: it must outlive a crash of the service (recover() then resumes the
        # tree); a crash of the machine loses the suspended GPU state anyway.
        m.save(folder, durable=False)
        self.log.info(
            "%s: checkpoint %s writing (pid %s, %d processes)",
            server.key,
            self._id(folder),
            pid,
            len(pids),
        )
        return LocalSuspension(
            server, started=t0, id=self._id(folder), folder=folder, manifest=m, pids=pids
        )

    async def do_freeze(self, s: LocalSuspension) -> None:
        """GPU memory to host memory (the CUDA checkpoint API): the GPU is free from here.
        A busy GPU refuses (the driver rolled back): the folder goes, nothing changed."""
        cuda = self.cuda()
        if cuda is not None:
            try:
                s.cuda_pids = await cuda.suspend(s.pids, lock_timeout_ms=self.lock_timeout_ms)
            except CheckpointRefused as e:
                # Nothing changed (the driver rolled back): not a failed image, just not now.
                shutil.rmtree(s.folder, ignore_errors=True)
                self.log.info("%s: checkpoint refused: %s", s.server.key, e)
                raise
        s.manifest.cuda_pids = s.cuda_pids
        s.manifest.time_to_gpu_free_s = round(time.monotonic() - s.started, 3)

    async def do_dump(self, s: LocalSuspension) -> None:
        """``criu dump --leave-stopped`` (packed into chunks while CRIU writes, with
        ``storage = 'chunks'``)."""
        m, folder, pid = s.manifest, s.folder, s.server.pid
        cuda = self.cuda()
        # What the GPU step does not need, read after it rather than before.
        m.ip, m.port = listen_address(pid)
        m.api_token = self._seal_token(environ_of(pid, "JUPYTERHUB_API_TOKEN"))
        if cuda is not None and m.gpu_count and not m.driver_version:
            m.driver_version = cuda.driver_version() or ""
        m.save(folder)
        t1 = time.monotonic()
        store = self.image_store(self.storage)
        s.follower = await store.begin(folder)
        with store.writeback(folder):
            await criu.dump(
                pid,
                folder,
                criu=self.criu_path,
                tcp=self.tcp_mode,
                leave_stopped=True,
                extra=[*sandbox.dump_args(pid), *self.dump_extra_args],
                timeout=self.dump_timeout,
            )
        m.dump_seconds = round(time.monotonic() - t1, 3)

    async def do_verify(self, s: LocalSuspension) -> None:
        """Complete, checksummed, durable (:meth:`_verify_dump`), and the tree still frozen."""
        await self._verify_dump(s.folder, s.manifest, s.follower)
        if s.phase == "recover":
            return  # do_dumped checked the tree
        if not all(is_frozen(p) or not is_alive(p) for p in s.pids[:1]):
            raise CheckpointError(f"process {s.server.pid} is no longer frozen after the dump")

    async def do_record(self, s: LocalSuspension) -> CheckpointInfo:
        m = s.manifest
        m.status = "verified"
        m.verified_at = time.time()
        m.save(s.folder)
        return self.info(s.folder, m)

    async def do_end(self, s: LocalSuspension, info: CheckpointInfo) -> None:
        """Only now, the image safe: the frozen tree is killed; a chunk checkpoint's raw
        files go, a lazy-mode one gets its page checksums in the background."""
        m, folder = s.manifest, s.folder
        if s.phase == "recover":  # completed after a crash: a still-frozen tree goes
            if s.frozen:
                await self.kill_tree(s.pids)
            self.log.warning("%s: checkpoint %s completed at recovery", s.server.key, s.id)
            return
        await self.kill_tree(s.pids)
        self.image_store(m.storage).after_verified(folder)
        if m.storage == "files" and self.restores_lazily(m):
            # nobody waits for them: a restore that comes first is eager
            cid = self._id(folder)
            self.page_sums[cid] = asyncio.ensure_future(
                self._write_page_sums(folder, m, s.server.key)
            )
        self.log.info(
            "%s: checkpoint %s verified (%.1f MiB, GPU free after %.2fs, dump %.2fs, "
            "checksums and fsync %.2fs, %s); processes ended",
            s.server.key, self._id(folder), m.image_bytes / 2**20, m.time_to_gpu_free_s,
            m.dump_seconds, m.seal_seconds, m.verification,
        )  # fmt: skip

    async def _undo_interrupted(self, s: LocalSuspension, why: str) -> None:
        """A suspension a crash interrupted, not to be completed: the tree resumed if it
        runs (its GPU state may be checkpointed even if the service died before recording
        it), the checkpoint failed."""
        m, folder, key = s.manifest, s.folder, s.server.key
        if s.root_alive:
            await self._fail(folder, m, key, s.pids, m.cuda_pids or s.pids, why)
            return
        m.status, m.error = "failed", why + " and the process is gone"
        if m.storage == "chunks":
            drop_image_files(folder)
        m.save(folder)
        self.log.error("%s: checkpoint %s failed at recovery: %s", key, s.id, m.error)

    async def do_resume(self, s: LocalSuspension, error: Exception) -> Exception:
        """SIGCONT, GPU memory back, the image kept ``failed`` (:meth:`_fail`); the error
        says why and that the server keeps running."""
        key = s.server.key
        if s.phase == "recover":
            await self._undo_interrupted(s, str(error))
            return error
        if s.phase == "freeze":
            await self._fail(
                s.folder, s.manifest, key, s.pids, [], f"GPU checkpoint failed: {error}"
            )
            return CheckpointError(f"{key}: GPU checkpoint failed, server left running: {error}")
        if s.follower is not None:
            await asyncio.to_thread(s.follower.close)
        why = await self._fail(s.folder, s.manifest, key, s.pids, s.cuda_pids, str(error))
        if isinstance(error, CheckpointError):
            return CheckpointError(f"{key}: {why}; the server keeps running")
        return CheckpointError(
            f"{key}: checkpoint failed ({type(error).__name__}: {why}); the server keeps running"
        )

    async def _verify_dump(
        self, folder: Path, m: Manifest, follower: Follower | None = None
    ) -> None:
        """Make a finished dump "verified" (see :mod:`.local`'s docstring) or raise CheckpointError:
        complete (CRIU's files and its success line), then sealed by the image store.

        Fills ``files``, ``sizes``, ``chunk_bytes``, ``image_bytes`` and ``verification``.
        """
        t = time.monotonic()
        problems = await asyncio.to_thread(check_complete, folder)
        if problems:
            raise CheckpointError("image verification failed: " + "; ".join(problems[:5]))
        await self.image_store(self.storage).seal(folder, m, follower)
        m.seal_seconds = round(time.monotonic() - t, 3)

    def _seal_token(self, token: str) -> str:
        """The server's API token as the manifest keeps it: sealed when encrypting at rest."""
        keys = self.keys() if token else []
        if not keys:
            return token
        return "sealed:" + keys[0].seal(token.encode(), b"api_token").hex()

    async def _fail(
        self, folder: Path, m: Manifest, key: str, pids: list[int], cuda_pids: list[int], why: str
    ) -> str:
        """Let the server go on (SIGCONT, GPU memory back) and keep the image as ``failed``;
        the reason recorded (``why`` and what was found and done about it)."""
        self.resume_tree(pids)
        if cuda_pids and self.cuda() is not None:
            try:
                await self.cuda().resume(cuda_pids)
            except Exception as e:
                why += f"; resuming GPU memory failed too: {e}"
        full = _disk_full(why, folder)
        if m.storage == "chunks" and not full:
            # CRIU's raw files of a chunk checkpoint are the server's memory unencrypted and
            # of no use once it failed (the server runs on): never left on the disk
            freed = await asyncio.to_thread(drop_image_files, folder)
            if freed:
                why += f"; its raw image files ({freed / 2**20:.1f} MiB of the server's memory) were deleted"
        while True:
            if full:
                # A half-written image is of no use (the server runs on) and keeps every
                # other suspension from fitting: give the space back, keep logs and manifest.
                # (CRIU's log is on the same disk, so it may be cut short before it says
                # why; the disk is asked too, and a record that does not fit says so.)
                freed = await asyncio.to_thread(drop_image_files, folder)
                why += (
                    f"; the disk holding {self.root} is full (No space left on device): the "
                    f"partial image ({freed / 2**20:.1f} MiB) was deleted. Free space there, "
                    "move LocalBackend.checkpoint_dir, or lower keep_last/max_age_days"
                )
            m.status, m.error = "failed", why
            try:
                m.save(folder)
            except OSError as e:
                if not full and e.errno in (errno.ENOSPC, errno.EDQUOT):
                    full = True  # no room even for the record: free the image, record again
                    continue
                # apply_retention()'s recover() records it once it can
                self.log.error("%s: cannot record failure in %s: %s", key, folder, e)
            break
        self.log.error("%s: checkpoint %s failed, server resumed: %s", key, self._id(folder), why)
        return why

    @staticmethod
    def resume_tree(pids: list[int]) -> None:
        """SIGCONT every process of a tree (undoes ``--leave-stopped``)."""
        for p in pids:
            try:
                os.kill(p, signal.SIGCONT)
            except OSError:
                pass

    async def kill_tree(self, pids: list[int]) -> None:
        """SIGKILL a (frozen) tree and wait until it is gone; reap our own children."""
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        deadline = time.monotonic() + self.kill_timeout
        me = os.getpid()
        while True:
            left = []
            for p in pids:
                try:
                    proc = psutil.Process(p)
                    if proc.ppid() == me:
                        os.waitpid(p, os.WNOHANG)
                    if proc.status() != psutil.STATUS_ZOMBIE:
                        left.append(p)
                except (psutil.Error, ChildProcessError):
                    continue
            if not left:
                return
            if time.monotonic() > deadline:
                self.log.warning(
                    "processes %s still present %gs after SIGKILL", left, self.kill_timeout
                )
                return
            await asyncio.sleep(0.05)

    # ---------------------------------------------------------------- recovery
    async def do_unfinished(self) -> list[LocalSuspension]:
        """Checkpoints left ``writing`` by a service that died mid-dump (not those this
        process writes now). On the way, what a crash left of others: raw image files of
        packed or failed-and-encrypted checkpoints go, and lazy restores the Hub left
        unfinished are resolved (:meth:`_recover_lazy`, :meth:`_recover_gpu_behind`)."""
        left = []
        for folder, m in self._load_all():
            if m.status != "writing" and (
                m.storage == "chunks" or (m.status == "failed" and self.encryption_key_file)
            ):
                # raw files a crash left after packing, or of a failed checkpoint on a host
                # that encrypts at rest (older versions recorded "files" until packed)
                drop_image_files(folder)
            if m.status == "restored" and m.extra.get("lazy_pending"):
                self._recover_lazy(folder, m)
            elif m.status == "restored" and m.extra.get("gpu_pending"):
                await self._recover_gpu_behind(folder, m)
            if m.status != "writing":
                continue
            key = server_key(m.user, m.server)
            if key in self._active:  # being written by this process right now
                continue
            root_alive = is_alive(m.pid)
            left.append(
                LocalSuspension(
                    Server(user=m.user, name=m.server, state={"pid": m.pid}),
                    id=self._id(folder),
                    folder=folder,
                    manifest=m,
                    pids=[p for p in (m.extra.get("tree") or [m.pid]) if is_alive(p)],
                    root_alive=root_alive,
                    frozen=root_alive and is_frozen(m.pid),
                )
            )
        return left

    async def do_dumped(self, s: LocalSuspension) -> bool:
        """CRIU said it finished, and the tree is still frozen (or gone)."""
        return _dump_finished(s.folder) and (s.frozen or not s.root_alive)


# Less free space than this after a failed dump counts as a full disk (CRIU stops at
# its first failed write, a few MiB of pages at most short of the end).
DISK_FULL_MARGIN = 16 << 20


def _disk_full(why: str, folder: Path) -> bool:
    """True if a failure's text says the disk (or the quota) is full, or the disk holding
    ``folder`` has under DISK_FULL_MARGIN free (CRIU's log on a full disk may be cut
    short before it says so)."""
    if "No space left on device" in why or "Disk quota exceeded" in why:
        return True
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < DISK_FULL_MARGIN


def _dump_finished(folder: Path) -> bool:
    try:
        text = (folder / "dump.log").read_text(errors="replace")
    except OSError:
        return False
    return bool(re.search(r"Dumping finished successfully", text))
