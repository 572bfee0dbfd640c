"""The one restore flow both spawners share: :class:`RestoreMixin`.

A suspended server's start finds the checkpoint its stop recorded, tells the user, has the
checkpoint restored, waits until the server answers, and only then takes back the Hub API
token the restored processes hold. When any of that fails, the checkpoint is kept for the
admin, the token it would have resumed is revoked, the user is told why, and a fresh server
starts instead. The spawners supply only where they differ (the hooks listed on
:class:`RestoreMixin`): :mod:`jupyterhub_gpusnap.spawner` restores with the local backend on
the Hub's host, :mod:`jupyterhub_gpusnap.kubespawner` into a pod (through the node agent or
the container runtime).

What the spawner state keeps between a stop and the next start (``state["gpusnap"]``) is
:attr:`RestoreMixin.gpusnap_state`; its shape is the spawner's own (pages read the local
one), so it is read and written only by each spawner's hooks.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import fields
from datetime import datetime, timezone

from jupyterhub.utils import url_escape_path, url_path_join
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from traitlets import Float, default
from traitlets.config import LoggingConfigurable

from .checkpoint.base import CheckpointError, CheckpointInfo, CheckpointRefused
from .model import server_key

#: Key of our record inside the spawner state (see :attr:`RestoreMixin.gpusnap_state`).
STATE_KEY = "gpusnap"


def human_bytes(n: float) -> str:
    """``12.3 GiB`` style sizes for progress messages (``512 B`` below a KiB)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def checkpoint_info(checkpoint: dict) -> CheckpointInfo:
    """The :class:`CheckpointInfo` of a checkpoint dict the spawner state keeps
    (``CheckpointInfo.as_dict()``; keys that are no field of it, such as ``server``, left out)."""
    names = {f.name for f in fields(CheckpointInfo)}
    return CheckpointInfo(**{k: v for k, v in checkpoint.items() if k in names})


class RestoreMixin(LoggingConfigurable):
    """Restore-on-start for a spawner: mix in before the spawner class (a JupyterHub
    ``Spawner``, whose attributes it uses).

    ``start()`` (or KubeSpawner's ``_start()``) returns :meth:`restore_or_start_fresh`.

    Subclasses implement:

    - :meth:`checkpoint_to_restore`: the checkpoint (a :class:`CheckpointInfo` dict) the
      start restores, or None;
    - :meth:`resume_token`: the API token the checkpointed server holds;
    - :meth:`restore_checkpoint`: bring the server back (any progress of its own on the
      way) and return the URL where it will answer;
    - :meth:`restore_exited`: why the restored server is gone while it is waited for;
    - :meth:`restored`: keep what a restored server needs (the checkpoint consumed) and
      return what ``start()`` returns;
    - :meth:`discard_restore`: undo a failed restore, keep the checkpoint for the admin;
    - :meth:`start_fresh`: start a fresh server;

    and set :attr:`progress_texts` (what the user reads, in the spawner's own words).
    """

    restore_timeout = Float(
        300.0,
        help="""Seconds a whole restore (the checkpoint brought back, GPU memory included, and
        the server answering) may take before it counts as failed and a fresh server is
        started instead. Large GPU images need more: roughly 1 s per GiB on a local disk.
        Keep ``Spawner.start_timeout`` (Z2JH: ``singleuser.startTimeout``) larger than this
        plus a normal start, or the Hub gives up first.""",
    ).tag(config=True)

    server_poll_interval = Float(
        0.5,
        help="Seconds between checks that a restored server answers.",
    ).tag(config=True)

    @default("server_token_scopes")
    def _default_server_token_scopes(self):
        # JupyterHub's default plus access to the service: the server's extension reports its
        # kernels and terminals to the service with this token, and the Lab panel asks the
        # service with it (the Hub grants it only where users hold that access too:
        # hubconfig.user_role). A service named other than 'gpusnap': set
        # c.Spawner.server_token_scopes = hubconfig.server_token_scopes("<name>").
        from .hubconfig import server_token_scopes

        return server_token_scopes("gpusnap")

    #: What the user reads while a checkpoint is restored (``{size}``, ``{when}``,
    #: ``{reason}`` filled in), each with its progress percentage; ``when_format`` is the
    #: strftime of ``{when}``.
    progress_texts: dict = {
        "when_format": "%Y-%m-%d %H:%M UTC",
        "restoring": ("Restoring your server from a {size} snapshot taken {when}…", 5),
        "waiting": ("Memory restored; waiting for the server to answer…", 80),
        "restored": ("Server restored from its snapshot.", 100),
        "failed": (
            "Could not restore your snapshot ({reason}). Starting a fresh server instead; "
            "the snapshot is kept — ask your admin if you need it back.",
            50,
        ),
    }

    #: Seconds past ``restore_timeout`` the whole restore is given before it is cut off
    #: (room for a backend's own timeout, which says more, to fire first).
    restore_grace: float = 0.0

    #: A checkpoint whose :meth:`resume_token` is empty is not restored (its processes
    #: hold a token only the checkpoint kept).
    resume_token_required: bool = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        #: What the spawner state keeps under ``STATE_KEY`` (the checkpoint the next start
        #: restores, and what goes with it); it survives ``clear_state()`` on purpose: the
        #: Hub clears state after every stop and before every start, and the restore needs it.
        self.gpusnap_state: dict = {}
        self._progress_events: list[dict] = []
        self._progress_changed = asyncio.Event()
        self._start_done = False

    # ------------------------------------------------------------------ naming
    @property
    def server_key(self) -> str:
        """``user/server_name`` of this server, the name used in every log line."""
        return server_key(self.user.name, self.name)

    # ------------------------------------------------------------------ state
    def load_state(self, state: dict) -> None:
        super().load_state(state)
        if state.get(STATE_KEY):
            self.gpusnap_state = dict(state[STATE_KEY])

    def get_state(self) -> dict:
        state = super().get_state()
        if self.gpusnap_state:
            # may hold the server's API token while suspended: spawner state is a secret
            state[STATE_KEY] = dict(self.gpusnap_state)
        return state

    def clear_state(self) -> None:
        # gpusnap_state survives on purpose (see __init__)
        super().clear_state()

    # ------------------------------------------------------------------ hooks
    async def checkpoint_to_restore(self) -> dict | None:
        """The checkpoint this start restores (a ``CheckpointInfo.as_dict()``), or None to
        start fresh. May raise to refuse the start (a snapshot that must not be passed over)."""
        raise NotImplementedError

    async def resume_token(self, checkpoint: dict) -> str:
        """The API token the checkpointed server holds (``""``: none kept). Raises
        :class:`CheckpointRefused` when it cannot be read now but is not lost."""
        raise NotImplementedError

    async def restore_checkpoint(self, checkpoint: dict) -> str:
        """Bring the checkpointed server back; return the URL (``http://ip:port``) where it
        will answer. Raise on failure (the flow then calls :meth:`discard_restore`)."""
        raise NotImplementedError

    def restore_exited(self) -> str:
        """Why the restored server is known to be gone while it is waited for (``""``: not
        known to be gone)."""
        return ""

    def restored(self, checkpoint: dict, url: str):
        """The restored server answers at ``url``: forget the checkpoint, keep what the
        server needs; return what ``start()`` returns (the URL, or ``(ip, port)``)."""
        raise NotImplementedError

    async def discard_restore(self, checkpoint: dict, error: BaseException, reason: str) -> None:
        """The restore failed: end what it started, keep the checkpoint for the admin (marked
        failed where the backend keeps a status), forget it for the next start."""
        raise NotImplementedError

    async def restore_failure_reason(self, checkpoint: dict, error: BaseException) -> str:
        """The reason the user reads for a failed restore."""
        if isinstance(error, asyncio.TimeoutError):
            return f"the restore did not finish within {self.restore_timeout:g}s"
        return str(error) or type(error).__name__

    async def start_fresh(self):
        """Start a fresh server; return what ``start()`` returns."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the flow
    async def restore_or_start_fresh(self):
        """Restore the server's checkpoint if there is one, else start a fresh server."""
        self._progress_events = []
        self._start_done = False
        try:
            checkpoint = await self.checkpoint_to_restore()
            if checkpoint is not None:
                try:
                    return await asyncio.wait_for(
                        self._restore(checkpoint), self.restore_timeout + self.restore_grace
                    )
                except CheckpointRefused as e:
                    # not now (its port still taken, its key missing…): the spawn fails,
                    # the snapshot stays verified and the next start tries again
                    self.log.warning("%s: restore not possible yet: %s", self.server_key, e)
                    raise
                except Exception as e:
                    await self._fall_back(checkpoint, e)
            return await self.start_fresh()
        finally:
            self._start_done = True
            self._progress_changed.set()

    async def _restore(self, checkpoint: dict) -> str:
        t0 = time.monotonic()
        texts = self.progress_texts
        size = human_bytes(int(checkpoint.get("image_bytes") or 0))
        taken = checkpoint.get("created")
        when = (
            datetime.fromtimestamp(taken, timezone.utc).strftime(texts["when_format"])
            if taken
            else "earlier"
        )
        token = await self.resume_token(checkpoint)
        if not token and self.resume_token_required:
            raise CheckpointError(
                f"checkpoint {checkpoint.get('id')} records no Hub API token to resume with"
            )
        self.log.info(
            "%s: restoring checkpoint %s (%s)", self.server_key, checkpoint.get("id"), size
        )
        self._emit_text("restoring", size=size, when=when)
        url = await self.restore_checkpoint(checkpoint)
        self._emit_text("waiting")
        await self._wait_answering(url, max(5.0, self.restore_timeout - (time.monotonic() - t0)))
        if token:
            # only now that it runs: reusing it before leaked the Hub's fresh token on failure
            self.api_token = token
        started = self.restored(checkpoint, url)
        self.log.info(
            "%s: restored from checkpoint %s at %s in %.2fs",
            self.server_key, checkpoint.get("id"), url, time.monotonic() - t0,
        )  # fmt: skip
        self._emit_text("restored")
        return started

    async def _wait_answering(self, url: str, timeout: float) -> None:
        """Wait until the restored server answers HTTP on its API (any non-5xx answer)."""
        if self.orm_spawner is not None and self.orm_spawner.server is not None:
            base = self.orm_spawner.server.base_url
        else:
            base = url_path_join(self.user.url, url_escape_path(self.name), "/")
        target = url_path_join(url, base, "api")
        client = AsyncHTTPClient()
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            gone = self.restore_exited()
            if gone:
                raise CheckpointError(gone)
            try:
                resp = await client.fetch(
                    HTTPRequest(target, request_timeout=5, connect_timeout=5), raise_error=False
                )
                if resp.code < 500 and resp.code != 599:
                    return
                last = f"HTTP {resp.code}"
            except (OSError, HTTPClientError) as e:  # HTTPClientError: no answer within 5 s
                last = str(e)
            self.log.debug("%s: waiting for %s (%s)", self.server_key, target, last)
            await asyncio.sleep(self.server_poll_interval)
        raise CheckpointError(
            f"restored server did not answer at {target} within {timeout:.0f}s ({last})"
        )

    async def _fall_back(self, checkpoint: dict, error: BaseException) -> None:
        """Undo the failed restore, revoke the token it would have resumed, tell the user."""
        reason = await self.restore_failure_reason(checkpoint, error)
        self.log.error(
            "%s: restore of checkpoint %s failed: %s. Starting a fresh server; the checkpoint "
            "is kept and can be restored by an admin.",
            self.server_key, checkpoint.get("id"), str(error) or reason,
        )  # fmt: skip
        try:
            token = await self.resume_token(checkpoint)
        except CheckpointRefused:
            token = ""  # sealed with a key that is gone: nothing to revoke it by
        await self.discard_restore(checkpoint, error, reason)
        self.revoke_token(token)
        self._emit_text("failed", reason=reason)

    # ------------------------------------------------------------------ tokens
    def token_id(self, token: str) -> int | None:
        """The Hub database id of an API token (None if unknown)."""
        if not token or getattr(self, "user", None) is None:
            return None
        try:
            from jupyterhub import orm

            found = orm.APIToken.find(self.user.db, token)
            return found.id if found is not None else None
        except Exception:
            return None

    def revoke_token(self, token: str) -> None:
        """Revoke a suspended server's API token that no server holds any more (never the
        running server's own)."""
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

    def revoke_token_id(self, token_id: int | None) -> None:
        """Revoke the API token with database id ``token_id`` (not the running server's)."""
        if token_id is None or token_id == self.token_id(self.api_token):
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
            self.log.warning(
                "%s: could not revoke the lost snapshot's token: %s", self.server_key, e
            )

    # ------------------------------------------------------------------ progress
    def emit(self, message: str, progress: int | None = None) -> None:
        """Add a progress event for the spawn page."""
        event: dict = {"message": message}
        if progress is not None:
            event["progress"] = progress
        self._progress_events.append(event)
        self._progress_changed.set()

    def _emit_text(self, what: str, **facts) -> None:
        message, progress = self.progress_texts[what]
        self.emit(message.format(**facts), progress)

    def base_progress(self):
        """The base spawner's own progress events to interleave with ours (an async
        iterator), or None (the default: Spawner's generic 'Spawning server...' is not shown)."""
        return None

    async def progress(self):
        """Our restore messages ("restoring 1.2 GiB snapshot from …"), interleaved with the
        base spawner's (:meth:`base_progress`), until the start is done."""
        theirs_events: list[dict] = []
        source = self.base_progress()
        pump_task = None
        if source is not None:

            async def pump():
                async for event in source:
                    theirs_events.append(event)
                    self._progress_changed.set()

            pump_task = asyncio.ensure_future(pump())
        ours = theirs = 0
        try:
            while True:
                self._progress_changed.clear()
                while ours < len(self._progress_events):
                    yield self._progress_events[ours]
                    ours += 1
                while theirs < len(theirs_events):
                    yield theirs_events[theirs]
                    theirs += 1
                if self._start_done and (pump_task is None or pump_task.done()):
                    if ours == len(self._progress_events) and theirs == len(theirs_events):
                        break
                    continue
                try:
                    await asyncio.wait_for(self._progress_changed.wait(), 1)
                except asyncio.TimeoutError:
                    pass
        finally:
            if pump_task is not None:
                pump_task.cancel()
