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
server starts, and the progress page and the log say why.

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
from jupyterhub.utils import random_port
from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from traitlets import Bool, Dict, Float, Instance, Type, Unicode, default

from . import sandbox
from .checkpoint.base import CheckpointBackend, CheckpointError, CheckpointInfo, CheckpointRefused
from .checkpoint.local import LocalBackend, encode_name, is_alive

STATE_KEY = "gpusnap"


async def super_maybe(result):
    """Await what a base class returned if it is awaitable (Spawner.delete_forever may be either)."""
    if hasattr(result, "__await__"):
        await result  # the checkpoint a suspended server restores from


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


class SnapSpawnerMixin(LocalProcessSpawner):
    """Restore-on-start for local process spawners (mix in before the spawner class)."""

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

    restore_timeout = Float(
        300.0,
        help="""Seconds a restore (CRIU, GPU memory, the server answering) may take before it
        counts as failed and a fresh server is started instead. Large GPU images need more:
        roughly 1 s per GiB here. Keep Spawner.start_timeout larger than this.""",
    ).tag(config=True)

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

    snapshot = Dict(
        help="The checkpoint this server will restore from (id, ip, port, created, sizes)."
    )

    @default("server_token_scopes")
    def _default_server_token_scopes(self):
        # JupyterHub's default plus access to the service: the server's extension reports its
        # kernels and terminals to the service with this token, and the Lab panel asks the
        # service with it (the Hub grants it only where users hold that access too:
        # hubconfig.user_role). A service named other than 'gpusnap': set
        # c.Spawner.server_token_scopes = hubconfig.server_token_scopes("<name>").
        from .hubconfig import server_token_scopes

        return server_token_scopes("gpusnap")

    backend = Instance(CheckpointBackend)

    @default("backend")
    def _default_backend(self):
        return self.backend_class(parent=self)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._events: list[dict] = []
        self._start_done = False

    # ------------------------------------------------------------------ naming
    @property
    def server_key(self) -> str:
        return f"{self.user.name}/{self.name}"

    def _emit(self, message: str, progress: int | None = None) -> None:
        event: dict = {"message": message}
        if progress is not None:
            event["progress"] = progress
        self._events.append(event)

    async def delete_forever(self) -> None:
        """The user or named server is deleted: delete its checkpoints too (they hold its memory)."""
        await super_maybe(super().delete_forever())
        deleted = 0
        for info in await self.backend.list(self.user.name):
            if info.server_name == self.name:
                await self.backend.delete(info.id)
                deleted += 1
        self.snapshot = {}
        if deleted:
            self.log.info("%s: deleted with its %d checkpoint(s)", self.server_key, deleted)

    # ------------------------------------------------------------------ state
    def load_state(self, state: dict) -> None:
        super().load_state(state)
        if state.get(STATE_KEY):
            self.snapshot = dict(state[STATE_KEY])

    def get_state(self) -> dict:
        state = super().get_state()
        if self.snapshot:
            state[STATE_KEY] = dict(self.snapshot)
        if self.pid and self.port:
            # where the service reads /api/kernels without going through the proxy, which would
            # count its polls as activity (JupyterSignal.direct)
            state["gpusnap_url"] = f"http://{self.ip or '127.0.0.1'}:{self.port}"
        return state

    def clear_state(self) -> None:
        # self.snapshot survives on purpose: the Hub clears state after every stop and
        # before every start, and the restore needs it then.
        super().clear_state()

    @property
    def suspended_at(self) -> str:
        """When the pending checkpoint was taken (UTC, for pages), or ''."""
        created = self.snapshot.get("created")
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
        self.snapshot = {
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
        token_id = self._token_id(token or self.api_token)
        if token_id is not None:
            # revoked by id if the checkpoint (which holds the token itself) is lost
            self.snapshot["token_id"] = token_id
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
        self.snapshot = {}
        await super().stop(now=now)

    async def _wait_for_suspension(self, what: str) -> None:
        writing = getattr(self.backend, "writing", None)
        if writing is None:
            return
        pending = await writing(self.user.name, self.name)
        if pending is None:
            return
        self.log.info(
            "%s: %s waits for the suspension being written (%s)", self.server_key, what, pending.id
        )
        self._emit("waiting for the snapshot being taken of this server to finish…")
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
        self._events = []
        self._start_done = False
        self.will_resume = False
        try:
            if self.restore_on_start:
                await self._wait_for_suspension("start")
                info = await self._pending_checkpoint()
                if info is not None:
                    try:
                        return await self._restore(info)
                    except CheckpointRefused as e:
                        # not now (its port still taken…): the spawn fails, the snapshot
                        # stays verified and the next start tries again
                        self.log.warning("%s: restore not possible yet: %s", self.server_key, e)
                        raise
                    except Exception as e:
                        await self._restore_failed(info, e)
            self.snapshot = {}
            return await self._start_fresh()
        finally:
            self._start_done = True

    async def _pending_checkpoint(self) -> CheckpointInfo | None:
        info = await self.backend.latest(self.user.name, self.name)
        if info is None:
            if self.snapshot:
                self._snapshot_gone()
            self.snapshot = {}
            return None
        if self.snapshot.get("id") != info.id:
            self.log.warning(
                "%s: checkpoint %s was not recorded by this server's stop (its API token was not "
                "kept); starting a fresh server and leaving it on disk",
                self.server_key, info.id,
            )  # fmt: skip
            return None
        return info

    def _snapshot_gone(self) -> None:
        """The checkpoint this server's stop recorded can no longer be read (its manifest was
        deleted, or its folder): say so, and leave whatever is left of it for the admin."""
        cid = self.snapshot.get("id", "")
        where = ""
        folder = getattr(self.backend, "folder", None)
        if folder is not None and cid:
            try:
                where = f" in {folder(cid)}"
            except Exception:
                where = ""
        self.log.warning(
            "%s: checkpoint %s is gone or has no readable manifest.json; starting a fresh server. "
            "Any files left of it stay%s for recovery by hand (docs/operations.md)",
            self.server_key, cid, where,
        )  # fmt: skip
        # the suspended server's token is only in the lost manifest: revoke it by id
        self._revoke_id(self.snapshot.get("token_id"))
        when = self.snapshot.get("created_utc") or "your last suspension"
        self._emit(
            f"your snapshot from {when} could not be found; starting a fresh server "
            "(your admin may still recover it by hand)",
            10,
        )

    async def _restore(self, info: CheckpointInfo) -> tuple[str, int]:
        t0 = time.monotonic()
        when = datetime.fromtimestamp(info.created, timezone.utc).strftime("%H:%M UTC on %b %d")
        size = human_bytes(info.image_bytes)
        token = await self._resume_token(info)
        if not token:
            raise CheckpointError(f"checkpoint {info.id} records no Hub API token to resume with")
        self.log.info("%s: restoring checkpoint %s (%s)", self.server_key, info.id, size)
        self._emit(f"restoring {size} snapshot from {when}…", 20)
        if info.gpu_bytes:
            self._emit(f"restoring GPU memory ({human_bytes(info.gpu_bytes)})…", 40)
        restore = self.backend.restore(info, timeout=self.restore_timeout)
        restored = await asyncio.wait_for(restore, self.restore_timeout + 5)
        pid, ip, port = restored.pid, restored.ip, restored.port
        self.proc = None
        self.pid = pid
        ip = ip if ip not in ("", "0.0.0.0", "::") else "127.0.0.1"
        self._emit("waiting for the server to answer…", 70)
        try:
            await self._wait_answering(
                ip, port, max(5.0, self.restore_timeout - (time.monotonic() - t0))
            )
        except Exception:
            await self._kill_restored(pid)
            raise
        # Only now that it runs: take its old token back (the Hub drops the new one).
        self.api_token = token
        self.ip, self.port = ip, port
        self.snapshot = {}
        self.log.info(
            "%s: restored from %s as pid %s on %s:%s in %.2fs",
            self.server_key, info.id, pid, ip, port, time.monotonic() - t0,
        )  # fmt: skip
        self._emit("server is back", 90)
        return ip, port

    async def _wait_answering(self, ip: str, port: int, timeout: float) -> None:
        host = f"[{ip}]" if ":" in ip else ip
        base = self.server.base_url if self.server is not None else "/"
        url = f"http://{host}:{port}{base.rstrip('/')}/api"
        client = AsyncHTTPClient()
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if not is_alive(self.pid):
                raise CheckpointError(f"restored server (pid {self.pid}) exited")
            try:
                resp = await client.fetch(HTTPRequest(url, request_timeout=5), raise_error=False)
                if resp.code < 500 and resp.code != 599:
                    return
                last = f"HTTP {resp.code}"
            except OSError as e:
                last = str(e)
            await asyncio.sleep(0.1)
        raise CheckpointError(
            f"restored server did not answer at {url} within {timeout:.0f}s ({last})"
        )

    async def _kill_restored(self, pid: int) -> None:
        kill = getattr(self.backend, "kill_tree", None)
        if kill is not None:
            try:
                pids = [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
            except psutil.Error:
                pids = [pid]
            await kill(pids)
        self.pid = 0

    async def _restore_failed(self, info: CheckpointInfo, error: Exception) -> None:
        """Keep the image (failed), revoke the token it holds, tell the user, go on fresh."""
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        try:  # the backend may know better (a lazy restore's damaged page killed the tree)
            now = await self.backend.get(info.id)
        except Exception:
            now = None
        if now is not None and now.status == "failed" and now.error:
            reason = now.error.splitlines()[0]
        self.log.error(
            "%s: restore of checkpoint %s failed, starting a fresh server: %s",
            self.server_key, info.id, error,
        )  # fmt: skip
        mark = getattr(self.backend, "mark", None)
        if mark is not None:
            try:
                await mark(info.id, "failed", f"restore failed: {error}")
            except Exception as e:
                self.log.error(
                    "%s: cannot mark checkpoint %s failed: %s", self.server_key, info.id, e
                )
        try:
            token = await self._resume_token(info)
        except CheckpointRefused:
            token = ""  # sealed with a key that is gone: nothing to revoke it by
        self._revoke(token)
        self.snapshot = {}
        self.proc = None
        self.pid = 0
        self._emit(
            f"could not restore your snapshot ({reason}); it is kept for your admin. "
            "Starting a fresh server: unsaved kernel state is not in it.",
            50,
        )

    async def _resume_token(self, info: CheckpointInfo) -> str:
        """The API token the checkpointed server holds (kept in the backend's manifest)."""
        get = getattr(self.backend, "resume_token", None)
        try:
            return (await get(info.id)) if get else ""
        except CheckpointRefused:
            raise  # its key is missing: not now, and not lost (start() fails, the snapshot stays)
        except Exception as e:
            self.log.warning("%s: cannot read the token of %s: %s", self.server_key, info.id, e)
            return ""

    def _token_id(self, token: str) -> int | None:
        """The Hub database id of an API token (None if unknown)."""
        if not token or getattr(self, "user", None) is None:
            return None
        try:
            from jupyterhub import orm

            found = orm.APIToken.find(self.user.db, token)
            return found.id if found is not None else None
        except Exception:
            return None

    def _revoke_id(self, token_id: int | None) -> None:
        """Revoke the API token with database id ``token_id`` (not the running server's)."""
        if token_id is None or token_id == self._token_id(self.api_token):
            return
        try:
            from jupyterhub import orm

            db = self.user.db
            found = db.get(orm.APIToken, token_id)
            if found is not None:
                db.delete(found)
                db.commit()
                self.log.info("%s: revoked the lost snapshot's API token", self.server_key)
        except Exception as e:
            self.log.warning("%s: could not revoke the lost snapshot's token: %s", self.server_key, e)

    def _revoke(self, token: str) -> None:
        if not token or token == self.api_token:
            return
        try:
            from jupyterhub import orm

            db = self.user.db
            found = orm.APIToken.find(db, token)
            if found is not None:
                db.delete(found)
                db.commit()
        except Exception as e:
            self.log.warning(
                "%s: could not revoke the suspended server's token: %s", self.server_key, e
            )

    # ------------------------------------------------------------------ fresh start
    def _reserved_ports(self) -> set[int]:
        ports = getattr(self.backend, "reserved_ports", None)
        try:
            return set(ports()) if ports else set()
        except Exception as e:
            self.log.warning("cannot read reserved ports: %s", e)
            return set()

    def server_log_path(self) -> str:
        root = getattr(self.backend, "checkpoint_dir", "/var/log")
        return self.server_log_template.format(
            checkpoint_dir=root, user=encode_name(self.user.name), server=encode_name(self.name)
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
            port = random_port()
            while port in reserved:
                port = random_port()
            self.port = port
        env = self.get_env()
        cmd = self.server_command(env)
        log_path = self.server_log_path()
        # the backend's own way when it has one: missing parts 0700 inside checkpoint_dir,
        # where a plain makedirs would leave <checkpoint_dir> and <user> open to others
        make = getattr(self.backend, "make_private_dirs", None)
        if make is not None:
            make(os.path.dirname(log_path))
        else:
            os.makedirs(os.path.dirname(log_path), mode=0o700, exist_ok=True)
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

    # ------------------------------------------------------------------ progress
    async def progress(self):
        """Progress events for the spawn page ("restoring 1.2 GiB snapshot from …")."""
        i = 0
        while True:
            while i < len(self._events):
                yield self._events[i]
                i += 1
            if self._start_done:
                return
            await asyncio.sleep(0.1)


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
