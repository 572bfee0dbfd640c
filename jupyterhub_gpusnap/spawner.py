"""Spawners that bring a suspended server back: restore on start, keep its token across.

The service (not the spawner) suspends a server: ``LocalBackend.checkpoint(server)``
(GPU memory and the process tree saved and verified, the processes ended), then
``DELETE /users/{user}/servers/{name}`` through the Hub API. The Hub then finds the
processes gone (``poll``) or asks the spawner to stop them (``stop``); either way
:class:`SnapSpawnerMixin` sees a verified checkpoint newer than the server's start,
sets ``will_resume`` (so the Hub keeps the server's API token and OAuth client) and
records the checkpoint in the spawner state, where ``clear_state`` leaves it. The
token itself is not put in the Hub's database: the backend keeps it in the
checkpoint's root-only manifest, beside the image that holds it anyway.

On the next start the checkpoint is restored (CRIU, then GPU memory), the server is
waited for, and only then its old API token is taken back. When a restore fails the
checkpoint is marked ``failed`` (kept for diagnosis), the old token is revoked, a fresh
server starts, and the progress page and the log say why. That flow is
:class:`~jupyterhub_gpusnap.spawner_restore.RestoreMixin`'s, shared with the Kubernetes
spawner; this module supplies its local hooks.

Each server runs in the sandbox of :mod:`jupyterhub_gpusnap.sandbox`: its own PID and
mount namespace with its own ``/proc`` (which both CUDA and CRIU need), a tiny init that
passes stop signals on, the user switched inside, and its output in its own log file
(``<checkpoint_dir>/<user>/<server>/server.log``, opened inside the namespace): CRIU
refuses to restore a process whose open log file changed size, which a log shared with
the Hub always does. Ports of suspended servers are never handed to fresh servers.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import sys
import time
from datetime import datetime, timezone
from subprocess import Popen

import psutil
from jupyterhub.spawner import LocalProcessSpawner, SimpleLocalProcessSpawner
from traitlets import Bool, Float, Instance, Type, Unicode, default

from . import sandbox
from .checkpoint.base import CheckpointBackend, CheckpointRefused
from .checkpoint.local import LocalBackend
from .checkpoint.local_layout import encode_name
from .procs import is_alive, server_port
from .spawner_restore import RestoreMixin, checkpoint_info, human_bytes


async def super_maybe(result):
    """Await what a base class returned if it is awaitable (Spawner.delete_forever may be either)."""
    if hasattr(result, "__await__"):
        await result


#: the warm-up the first spawner of this process started (see _warm_up_once)
_WARM_UP: asyncio.Task | None = None


def _warm_up_once(backend: CheckpointBackend, log) -> None:
    """Start ``backend.warm_up()`` in the background, once per process (at the first spawner
    made while the Hub's loop runs: at start for servers already running, else at the first
    spawn), so that the first restore does not load the CUDA driver or check CRIU itself."""
    global _WARM_UP
    if _WARM_UP is not None:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return  # not in the Hub's loop yet: the next spawner made in it starts it
    _WARM_UP = loop.create_task(backend.warm_up())

    def said(task: asyncio.Task) -> None:  # warm_up() logs what is missing and never raises
        if not task.cancelled() and task.exception() is not None:
            log.warning("gpusnap warm-up failed: %r", task.exception())

    _WARM_UP.add_done_callback(said)


class SnapSpawnerMixin(RestoreMixin):
    """Restore-on-start for local process spawners: the local hooks of :class:`RestoreMixin`
    (mix in before LocalProcessSpawner or a subclass of it).

    :attr:`gpusnap_state` is the pending checkpoint's record (id, ip, port, created, sizes,
    token_id), read by the Hub's pages (templates/hub/) while the server is suspended.
    """

    backend_class = Type(
        LocalBackend,
        klass=CheckpointBackend,
        help="""The checkpoint backend the spawner restores from. It must be the same kind,
        and see the same checkpoint_dir, as the service's backend: configure it once
        (e.g. c.LocalBackend.checkpoint_dir) in a file both load.""",
    ).tag(config=True)

    restore_on_start = Bool(
        True,
        help="""Restore a suspended server's checkpoint when it is started again. False starts
        fresh servers and leaves checkpoints on disk (retention removes them).""",
    ).tag(config=True)

    @default("server_poll_interval")
    def _default_server_poll_interval(self) -> float:
        return 0.1

    suspend_wait_timeout = Float(
        600.0,
        help="""Seconds a start or stop waits for a suspension of the same server that is being
        written (its checkpoint in state 'writing'). After that the start or stop fails (and
        can be retried): it never kills processes CRIU is dumping, nor starts a second server
        beside them. Keep it above the time a dump takes (about 1 s per GiB of memory).""",
    ).tag(config=True)

    server_log_template = Unicode(
        "{checkpoint_dir}/{user}/{server}/server.log",
        help="""File receiving the server's stdout/stderr. It must be written by the server
        alone: CRIU refuses to restore a process whose open file changed size meanwhile.
        {checkpoint_dir}, {user} and {server} (path-safe, '_default' for '') are expanded.""",
    ).tag(config=True)

    progress_texts = {
        "when_format": "%H:%M UTC on %b %d",
        "restoring": ("restoring {size} snapshot from {when}…", 20),
        "waiting": ("waiting for the server to answer…", 70),
        "restored": ("server is back", 90),
        "failed": (
            "could not restore your snapshot ({reason}); it is kept for your admin. "
            "Starting a fresh server: unsaved kernel state is not in it.",
            50,
        ),
    }

    #: the backend's own restore_timeout (and its 5 s more here), then the wait for the
    #: server: their errors say more than the flow's cut-off
    restore_grace = 15.0

    #: the token is in the checkpoint's manifest: a checkpoint without one is not restored
    resume_token_required = True

    backend = Instance(CheckpointBackend)

    @default("backend")
    def _default_backend(self):
        backend = self.backend_class(parent=self)
        _warm_up_once(backend, self.log)
        return backend

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._restored_pid = 0  # a restored tree not handed out yet
        self._restored_at: tuple[str, int] = ("", 0)

    @property
    def pending_checkpoint(self) -> dict | None:
        """The record of the checkpoint the next start restores, or None."""
        return self.gpusnap_state if self.gpusnap_state.get("id") else None

    async def delete_forever(self) -> None:
        """The user or named server is deleted: delete its checkpoints too (they hold its memory)."""
        await super_maybe(super().delete_forever())
        deleted = 0
        for info in await self.backend.list(self.user.name):
            if info.server_name == self.name:
                await self.backend.delete(info.id)
                deleted += 1
        self.gpusnap_state = {}
        if deleted:
            self.log.info("%s: deleted with its %d checkpoint(s)", self.server_key, deleted)

    # ------------------------------------------------------------------ state
    def get_state(self) -> dict:
        state = super().get_state()
        if self.pid and self.port:
            # where the service reads /api/kernels without going through the proxy, which would
            # count its polls as activity (JupyterSignal.direct)
            state["gpusnap_url"] = f"http://{self.ip or '127.0.0.1'}:{self.port}"
        return state

    @property
    def suspended_at(self) -> str:
        """When the pending checkpoint was taken (UTC, for pages), or ''."""
        created = self.gpusnap_state.get("created")
        if not created:
            return ""
        return datetime.fromtimestamp(created, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

    # ------------------------------------------------------------------ poll / stop
    async def poll(self) -> int | None:
        """Like LocalProcessSpawner.poll, counting a zombie as gone; notes a suspension."""
        pid = self.pid
        token = self.api_token  # clear_state() forgets it
        if self.proc is None and pid and not is_alive(pid):
            self.clear_state()
            status = 0
        else:
            status = await super().poll()
        if status is not None and pid and await self._note_suspension(pid, token):
            status = 0  # ended on purpose, by a verified checkpoint: not a crash
        return status

    async def _note_suspension(self, pid: int, token: str = "") -> bool:
        """If the processes ended because they were checkpointed, keep what a restore needs
        (and say True)."""
        try:
            info = await self.backend.latest(self.user.name, self.name)
        except Exception as e:
            self.log.warning("%s: cannot read checkpoints: %s", self.server_key, e)
            return False
        if info is None:
            return False
        started = self.orm_spawner.started if self.orm_spawner is not None else None
        started_ts = started.replace(tzinfo=timezone.utc).timestamp() if started else None
        if info.extra.get("pid") != pid and not (started_ts and info.created >= started_ts):
            return False
        self.gpusnap_state = {
            "id": info.id,
            "ip": info.extra.get("ip") or self.ip or "127.0.0.1",
            "port": info.extra.get("port") or self.port,
            "created": info.created,
            "created_iso": datetime.fromtimestamp(info.created, timezone.utc).isoformat(),
            "created_utc": datetime.fromtimestamp(info.created, timezone.utc).strftime(
                "%Y-%m-%d %H:%M UTC"
            ),
            "image_bytes": info.image_bytes,
            "gpu_bytes": info.gpu_bytes,
        }
        token_id = self.token_id(token or self.api_token)
        if token_id is not None:
            # revoked by id if the checkpoint (which holds the token itself) is lost
            self.gpusnap_state["token_id"] = token_id
        self.will_resume = True
        self.log.info(
            "%s: suspended (checkpoint %s); it will be restored on the next start",
            self.server_key, info.id,
        )  # fmt: skip
        return True

    async def stop(self, now: bool = False) -> None:
        """Stop the server; if a suspension of it is being written, wait for that first."""
        await self._wait_for_suspension("stop")
        if await self.poll() is not None:
            return  # checkpointed (will_resume set by poll) or already gone
        self.gpusnap_state = {}
        await super().stop(now=now)

    async def _wait_for_suspension(self, what: str) -> None:
        pending = await self.backend.writing(self.user.name, self.name)
        if pending is None:
            return
        self.log.info(
            "%s: %s waits for the suspension being written (%s)", self.server_key, what, pending.id
        )
        self.emit("waiting for the snapshot being taken of this server to finish…")
        left = await self.backend.wait_settled(self.user.name, self.name, self.suspend_wait_timeout)
        if left is not None:
            # Never go on: a stop would kill the frozen processes under CRIU, a start would
            # run a second server beside them. Both are safe to retry later.
            raise RuntimeError(
                f"{self.server_key}: a snapshot of this server ({left.id}) is still being "
                f"written after {self.suspend_wait_timeout:g}s; try again later. If the gpusnap "
                "service is not running, start it: it finishes or undoes unfinished snapshots."
            )

    # ------------------------------------------------------------------ start
    async def start(self):
        """Restore the server's checkpoint if there is one, else start a fresh server."""
        self.will_resume = False
        return await self.restore_or_start_fresh()

    async def checkpoint_to_restore(self) -> dict | None:
        if not self.restore_on_start:
            return None
        await self._wait_for_suspension("start")
        info = await self.backend.latest(self.user.name, self.name)
        if info is None:
            if self.gpusnap_state:
                self._checkpoint_gone()
            self.gpusnap_state = {}
            return None
        if self.gpusnap_state.get("id") != info.id:
            self.log.warning(
                "%s: checkpoint %s was not recorded by this server's stop (its API token was not "
                "kept); starting a fresh server and leaving it on disk",
                self.server_key, info.id,
            )  # fmt: skip
            return None
        return info.as_dict()

    def _checkpoint_gone(self) -> None:
        """The checkpoint this server's stop recorded can no longer be read (its manifest was
        deleted, or its folder): say so, and leave whatever is left of it for the admin."""
        cid = self.gpusnap_state.get("id", "")
        where = ""
        if cid:
            try:
                place = self.backend.location(cid)
                where = f" in {place}" if place else ""
            except Exception:
                where = ""
        self.log.warning(
            "%s: checkpoint %s is gone or has no readable manifest.json; starting a fresh server. "
            "Any files left of it stay%s for recovery by hand (docs/operations.md)",
            self.server_key, cid, where,
        )  # fmt: skip
        # the suspended server's token is only in the lost manifest: revoke it by id
        self.revoke_token_id(self.gpusnap_state.get("token_id"))
        when = self.gpusnap_state.get("created_utc") or "your last suspension"
        self.emit(
            f"your snapshot from {when} could not be found; starting a fresh server "
            "(your admin may still recover it by hand)",
            10,
        )

    async def resume_token(self, checkpoint: dict) -> str:
        """The API token the checkpointed server holds (kept in the backend's manifest):
        a restore without one fails."""
        try:
            token = await self.backend.resume_token(checkpoint["id"])
        except CheckpointRefused:
            raise  # its key is missing: not now, and not lost (start() fails, the snapshot stays)
        except Exception as e:
            self.log.warning(
                "%s: cannot read the token of %s: %s", self.server_key, checkpoint["id"], e
            )
            token = ""
        return token

    async def restore_checkpoint(self, checkpoint: dict) -> str:
        info = checkpoint_info(checkpoint)
        if info.gpu_bytes:
            self.emit(f"restoring GPU memory ({human_bytes(info.gpu_bytes)})…", 40)
        restore = self.backend.restore(info, timeout=self.restore_timeout)
        restored = await asyncio.wait_for(restore, self.restore_timeout + 5)
        self.proc = None
        self.pid = self._restored_pid = restored.pid
        ip = restored.ip if restored.ip not in ("", "0.0.0.0", "::") else "127.0.0.1"
        self._restored_at = (ip, restored.port)
        self.log.info(
            "%s: checkpoint %s restored as pid %s on %s:%s",
            self.server_key, info.id, restored.pid, ip, restored.port,
        )  # fmt: skip
        host = f"[{ip}]" if ":" in ip else ip
        return f"http://{host}:{restored.port}"

    def restore_exited(self) -> str:
        if not is_alive(self.pid):
            return f"restored server (pid {self.pid}) exited"
        return ""

    def restored(self, checkpoint: dict, url: str) -> tuple[str, int]:
        self.ip, self.port = self._restored_at
        self._restored_pid = 0
        self.gpusnap_state = {}
        return self.ip, self.port

    async def restore_failure_reason(self, checkpoint: dict, error: BaseException) -> str:
        reason = (await super().restore_failure_reason(checkpoint, error)).splitlines()[0]
        try:  # the backend may know better (a lazy restore's damaged page killed the tree)
            now = await self.backend.get(checkpoint["id"])
        except Exception:
            now = None
        if now is not None and now.status == "failed" and now.error:
            reason = now.error.splitlines()[0]
        return reason

    async def discard_restore(self, checkpoint: dict, error: BaseException, reason: str) -> None:
        """End the restored tree if it runs, mark the checkpoint failed (its image is kept)."""
        pid, self._restored_pid = self._restored_pid, 0
        if pid:  # restored, but it did not answer
            try:
                pids = [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
            except psutil.Error:
                pids = [pid]
            await self.backend.kill_tree(pids)
        try:
            await self.backend.mark(
                checkpoint["id"], "failed", f"restore failed: {str(error) or reason}"
            )
        except Exception as e:
            self.log.error(
                "%s: cannot mark checkpoint %s failed: %s", self.server_key, checkpoint["id"], e
            )
        self.gpusnap_state = {}
        self.proc = None
        self.pid = 0

    async def start_fresh(self):
        self.gpusnap_state = {}
        return await self._start_fresh()

    # ------------------------------------------------------------------ fresh start
    def _reserved_ports(self) -> set[int]:
        try:
            return set(self.backend.reserved_ports())
        except Exception as e:
            self.log.warning("cannot read reserved ports: %s", e)
            return set()

    def server_log_path(self) -> str:
        return self.server_log_template.format(
            checkpoint_dir=self.backend.log_root,
            user=encode_name(self.user.name),
            server=encode_name(self.name),
        )

    def sandbox_user(self) -> str | None:
        """The system user the server runs as inside the sandbox (None: the Hub's own user)."""
        return None

    def server_command(self, env: dict) -> list[str]:
        """``cmd + args`` with the single-user command found: on the server's PATH, else
        next to the Hub's Python (where ``pip install jupyterhub`` put it; that folder is
        then put first on the server's PATH too). A clear error if it is in neither."""
        cmd = list(self.cmd) + self.get_args()
        exe = cmd[0]
        path = env.get("PATH", os.defpath)
        found = shutil.which(exe, path=path)
        if found is None:
            here = os.path.dirname(sys.executable)
            found = shutil.which(exe, path=here)
            if found is None:
                raise RuntimeError(
                    f"{self.server_key}: the server command {exe!r} is neither on the server's "
                    f"PATH ({path}) nor next to the Hub's Python ({here}): install jupyterhub "
                    "there (it provides jupyterhub-singleuser), or set c.Spawner.cmd to the "
                    "command's absolute path"
                )
            env["PATH"] = here + os.pathsep + path
        cmd[0] = found
        if self.shell_cmd:
            cmd = self.shell_cmd + [" ".join(shlex.quote(s) for s in cmd)]
        return cmd

    async def _start_fresh(self):
        reserved = self._reserved_ports()
        if self.port == 0 or self.port in reserved:
            self.port = server_port(self.ip, reserved)
        env = self.get_env()
        cmd = self.server_command(env)
        log_path = self.server_log_path()
        # the backend's own way: missing parts 0700 inside checkpoint_dir, where a plain
        # makedirs would leave <checkpoint_dir> and <user> open to others
        self.backend.make_private_dirs(os.path.dirname(log_path))
        full = sandbox.command(cmd, log_path, user=self.sandbox_user())
        self.log.info("%s: spawning %s", self.server_key, " ".join(shlex.quote(s) for s in full))
        popen_kwargs = dict(preexec_fn=self.make_preexec_fn(self.user.name), start_new_session=True)
        popen_kwargs.update(self.popen_kwargs)
        popen_kwargs["env"] = env
        self.proc = Popen(full, **popen_kwargs)
        self.pid = await self._namespace_init(self.proc)
        return (self.ip or "127.0.0.1", self.port)

    async def _namespace_init(self, proc: Popen, timeout: float = 10) -> int:
        """The host pid of the sandbox's init (the root of the tree CRIU dumps): the
        launcher's only child."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                children = psutil.Process(proc.pid).children()
            except psutil.Error:
                children = []
            if children:
                return children[0].pid
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{self.server_key}: the server's sandbox exited with {proc.returncode} "
                    f"before it started (see the Hub's log and {self.server_log_path()})"
                )
            await asyncio.sleep(0.01)
        raise RuntimeError(f"{self.server_key}: no server sandbox after {timeout}s")


class SnapLocalProcessSpawner(SnapSpawnerMixin, LocalProcessSpawner):
    """LocalProcessSpawner with suspend/restore: servers run as their system users.

    The Hub runs as root; each server's sandbox is made as root and the server drops to
    its user inside it (the namespaces and ``/proc`` need root, so the switch happens
    there rather than in Popen's preexec).
    """

    def make_preexec_fn(self, name):
        import pwd

        home = pwd.getpwnam(name).pw_dir

        def preexec():
            try:
                os.chdir(home)
            except OSError:
                pass

        return preexec

    def sandbox_user(self) -> str | None:
        return self.user.name


class SnapSimpleLocalProcessSpawner(SnapSpawnerMixin, SimpleLocalProcessSpawner):
    """SimpleLocalProcessSpawner with suspend/restore (every server runs as the Hub's user).

    For demos and tests only, like its base class.
    """
