"""The contract every checkpoint backend follows (the shape of dask-gateway's backends).

:class:`CheckpointBackend` is the one interface the service, the spawners and the agent
use: every method they call is declared here, with what it takes and returns, and a
default where a backend may have nothing to do. Optional abilities are declared as
capabilities (:attr:`CheckpointBackend.supports_park`,
:attr:`CheckpointBackend.supports_gpu_memory`), never found by probing for attributes.

The base class owns the protocol, the way dask-gateway's ``DBBackendBase`` owns a
cluster's life: :meth:`~CheckpointBackend.checkpoint` (preflight once, freeze, dump, verify,
record, end; undo on any failure), :meth:`~CheckpointBackend.recover` (what a crash left
under way, with the same hooks) and :meth:`~CheckpointBackend.apply_retention`.

Subclasses should implement:

- the hooks of a suspension: ``do_preflight`` (refuses), ``do_freeze``, ``do_dump``,
  ``do_verify``, ``do_record``, ``do_end``, ``do_resume`` (what a failure undoes)
- :meth:`~CheckpointBackend.restore`
- :meth:`~CheckpointBackend.latest`, :meth:`~CheckpointBackend.list`,
  :meth:`~CheckpointBackend.delete`

and may supply ``do_unfinished``/``do_dumped`` (crash recovery),
``do_expired``/``do_delete``/``do_after_retention`` (retention, the rule being
:func:`expired`), and override the rest (records kept after the fact, scrub, the
capabilities, what a local spawner needs of the host). Where a local image is kept is
its own axis: :mod:`.image_store`.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from traitlets.config import LoggingConfigurable

from ..errors import CheckpointError, CheckpointRefused  # noqa: F401  (the contract's errors)
from ..model import Server

if TYPE_CHECKING:
    from ..gpu.park import ParkResult
    from ..gpu.view import GpuReading


@dataclass
class CheckpointInfo:
    """What the service and the spawner need to know of one checkpoint.

    ``id`` is unique per backend (local: the folder name; kubernetes: the image
    reference). ``status`` is one of ``writing``, ``verified``, ``restored``,
    ``failed``.
    """

    id: str
    user: str
    server_name: str
    created: float
    status: str
    image_bytes: int = 0
    gpu_bytes: int = 0
    gpu_model: str = ""
    gpu_count: int = 0
    location: str = ""
    error: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.user}/{self.server_name}"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["server"] = self.key
        return d


@dataclass
class Restored:
    """A server brought back from a checkpoint: what :meth:`CheckpointBackend.restore`
    returns, whatever the backend.

    ``pid`` is the root of the restored process tree (local: a pid of this host;
    Kubernetes: a pid on ``node``); ``ip`` and ``port`` where the server listens when the
    backend knows (local), else ``""`` and ``0`` (the spawner knows its pod's address).
    ``detail`` holds what a backend adds (its agent's answer, the restore's phases).
    """

    pid: int
    ip: str = ""
    port: int = 0
    node: str = ""
    detail: dict = field(default_factory=dict)


@dataclass
class RestoreTarget:
    """Where a restore goes when the caller chose the place (Kubernetes: the placeholder
    pod the node agent restores into). Backends that choose themselves (local: the
    checkpoint's own host) take ``None``.

    ``container`` empty: the backend's default container.
    """

    namespace: str
    pod: str
    container: str = ""


@dataclass
class Kept:
    """What retention knows of one checkpoint (:func:`expired`)."""

    id: str
    server: str  # "user/server"
    status: str
    created: float
    #: a snapshot that was verified and then failed (its restore failed, or a scrub found it
    #: damaged beyond repair): when it failed. Kept ``max_age_days`` from then for rescue.
    failed_since: float | None = None


def protected(found: list[Kept]) -> set[str]:
    """Per server, the newest ``verified`` checkpoint while nothing newer was restored or
    failed: the snapshot a suspended server is restored from. ``found`` newest first."""
    keep: set[str] = set()
    seen: set[str] = set()
    for k in found:
        if k.server in seen or k.status == "writing":
            continue
        seen.add(k.server)
        if k.status == "verified":
            keep.add(k.id)
    return keep


def expired(found: list[Kept], now: float, keep_last: int, max_age_days: float) -> list[str]:
    """The checkpoints retention deletes, of ``found`` (newest first): beyond the newest
    ``keep_last`` per server, or older than ``max_age_days``; never one being written, nor
    a suspended server's snapshot (:func:`protected`); a failed restore's snapshot only
    ``max_age_days`` after its failure, whatever ``keep_last`` says.

    >>> a = [Kept("3", "u/", "restored", 30), Kept("2", "u/", "restored", 20), Kept("1", "u/", "failed", 10)]
    >>> expired(a, now=40, keep_last=2, max_age_days=1)
    ['1']
    """
    keep = protected(found)
    counts: dict[str, int] = {}
    out = []
    for k in found:
        if k.status == "writing" or k.id in keep:
            counts[k.server] = counts.get(k.server, 0) + 1
            continue
        if k.failed_since is not None:  # a failed restore's snapshot: by age alone
            too_many, too_old = False, now - k.failed_since > max_age_days * 86400
        else:
            counts[k.server] = counts.get(k.server, 0) + 1
            too_many = counts[k.server] > keep_last
            too_old = now - k.created > max_age_days * 86400
        if too_many or too_old:
            out.append(k.id)
    return out


@dataclass
class Suspension:
    """One suspension under way, handed from hook to hook of
    :meth:`CheckpointBackend.checkpoint`. Backends subclass it for what their later
    hooks need (the image's folder, the frozen pids, the agent's answer).

    ``phase`` is the step under way (``preflight``, ``freeze``, ``dump``, ``verify``,
    ``record``, ``end``): :meth:`CheckpointBackend.do_resume` reads it to know what to undo.
    """

    server: Server
    started: float = field(default_factory=time.monotonic)
    phase: str = "preflight"
    #: the checkpoint's id, once the backend knows it
    id: str = ""


#: why :meth:`CheckpointBackend.recover` undoes a suspension it finds under way
INTERRUPTED = "the service stopped while this checkpoint was being written"


class CheckpointBackend(LoggingConfigurable):
    """Saves a running server to a verified checkpoint, and restores it.

    A backend never stops a server on its own: :meth:`checkpoint` either returns a
    *verified* checkpoint, after which the server's processes are gone (the caller
    then stops the server through the Hub), or raises and leaves the server running.

    The app picks one with ``GpuSnap.backend_class``; the spawners with their own
    ``checkpoint_backend_class``. Everything they call is declared on this class.
    """

    #: Capability: :meth:`park` moves a server's GPU memory to host memory and back
    #: where the server runs (Kubernetes: through the node agent). False: the caller parks
    #: servers of this host itself (the CUDA checkpoint API, ``gpu/park.py``).
    supports_park: bool = False

    #: Capability: :meth:`gpu_memory` reads the free memory of the GPUs the servers run
    #: on (Kubernetes: from every node's agent). False: the caller reads this host's GPUs.
    supports_gpu_memory: bool = False

    #: What :meth:`checkpoint` undoes with :meth:`do_resume`: any error. A backend whose
    #: suspension must be undone even when its caller is cancelled (the node agent: a pod's
    #: GPU memory never stays frozen while the agent runs) sets ``(BaseException,)``.
    undo_on: tuple[type[BaseException], ...] = (Exception,)

    # ------------------------------------------------------------------ life cycle
    async def setup(self) -> None:
        """Check prerequisites once at start-up (log what is missing) and resolve what a
        crash left behind (:meth:`recover`)."""

    async def warm_up(self) -> None:
        """Do now, in the background, what the first restore or suspension in this process
        would otherwise wait for (loading drivers, checking tools). The local spawners call
        it once per Hub process, when the first of them is made; never raises."""

    async def recover(self) -> list[str]:
        """Resolve suspensions a crash of the service left under way, with the hooks of
        :meth:`checkpoint`: each one :meth:`do_unfinished` finds is either completed (its
        dump finished, :meth:`do_dumped`, and checks out, :meth:`do_verify`: recorded by
        :meth:`do_record`, its frozen processes ended by :meth:`do_end`) or undone
        (:meth:`do_resume`: the server resumed, its GPU memory given back, the checkpoint
        marked ``failed``). The hooks see ``phase == "recover"``.

        Returns
        -------
        list of str
            The ids of the checkpoints resolved. Backends with nothing to resolve (their
            suspensions run in an agent that recovers itself) return ``[]``.
        """
        done = []
        for s in await self.do_unfinished():
            s.phase = "recover"
            if await self.do_dumped(s):
                try:
                    await self.do_verify(s)
                except (OSError, CheckpointError):
                    pass  # undone below
                else:
                    info = await self.do_record(s)
                    await self.do_end(s, info)
                    done.append(info.id)
                    continue
            await self.do_resume(s, CheckpointError(INTERRUPTED))
            done.append(s.id)
        return done

    async def do_unfinished(self) -> list[Suspension]:
        """The suspensions a crash left under way (none of this process's own)."""
        return []

    async def do_dumped(self, s: Suspension) -> bool:
        """Whether the dump of an unfinished suspension ended and it can be completed."""
        return False

    # ------------------------------------------------------------------ checkpoint
    async def check(self, server: Server) -> None:
        """Raise :class:`CheckpointRefused` if ``server`` cannot be checkpointed now.

        :meth:`checkpoint` runs the same checks itself, before it changes anything:
        call this only to ask, not before every :meth:`checkpoint`.
        """

    async def checkpoint(self, server: Server, **request) -> CheckpointInfo:
        """Checkpoint ``server`` (GPU memory, then the process tree), verify it, and return it.

        The protocol, the same for every backend; each step is a hook:

        1. :meth:`do_preflight`: every check, before anything changes (refuses with
           :class:`CheckpointRefused`); run once per suspension.
        2. :meth:`do_freeze`: GPU memory to host memory; the GPU is free from here. A
           :class:`CheckpointRefused` here means the freeze was rolled back: nothing changed.
        3. :meth:`do_dump`: the process tree to an image, the tree left frozen.
        4. :meth:`do_verify`: the image complete, checksummed and durable.
        5. :meth:`do_record`: the checkpoint recorded ``verified``.
        6. :meth:`do_end`: only now the frozen processes end.

        Any failure in steps 2-5 calls :meth:`do_resume` (the server goes on, its GPU memory
        back, the image kept as ``failed``) and raises the error it returns.

        Parameters
        ----------
        server : Server
            The running server (its pid for local servers, its pod for Kubernetes).
        **request
            What a backend's suspension needs besides the server, passed on to
            :meth:`do_preflight` (the node agent: the pod, its container, the kubelet's
            timeout, the store). The service's backends take none.

        Returns
        -------
        CheckpointInfo
            A ``verified`` checkpoint. On success the server's processes no longer run
            and the GPU is free.

        Raises
        ------
        CheckpointRefused
            Nothing was changed (checked first: CRIU, the process, the disk, a busy GPU).
        CheckpointError
            Any other failure; the server keeps running.
        """
        s = await self.do_preflight(server, **request)
        try:
            for phase, step in (
                ("freeze", self.do_freeze),
                ("dump", self.do_dump),
                ("verify", self.do_verify),
            ):
                s.phase = phase
                await step(s)
            s.phase = "record"
            info = await self.do_record(s)
        except self.undo_on as e:
            if isinstance(e, CheckpointRefused) and s.phase == "freeze":
                raise  # rolled back by the driver: nothing to resume
            failure = await self.do_resume(s, e)
            if failure is e:
                raise
            raise failure from e
        s.phase = "end"
        await self.do_end(s, info)
        return info

    # The hooks of checkpoint(). A backend that runs the whole suspension elsewhere (an
    # agent) does it in do_dump and leaves the others as they are.
    async def do_preflight(self, server: Server, **request) -> Suspension:
        """Check everything that can be checked before anything changes; the
        :class:`Suspension` the other hooks get (with what ``request`` holds). Raises
        :class:`CheckpointRefused`."""
        raise NotImplementedError

    async def do_freeze(self, s: Suspension) -> None:
        """Move the server's GPU memory to host memory (the GPU is free from here)."""

    async def do_dump(self, s: Suspension) -> None:
        """Write the process tree's image, leaving the tree frozen."""

    async def do_verify(self, s: Suspension) -> None:
        """Make sure the image is complete, checksummed and durable; raise
        :class:`CheckpointError` if it is not."""

    async def do_record(self, s: Suspension) -> CheckpointInfo:
        """Record the checkpoint as ``verified`` and return it."""
        raise NotImplementedError

    async def do_end(self, s: Suspension, info: CheckpointInfo) -> None:
        """End the frozen server's processes (its image is safe) and tidy up."""

    async def do_resume(self, s: Suspension, error: Exception) -> Exception:
        """Undo a suspension that failed in ``s.phase``: the server goes on (its processes
        continued, its GPU memory back), the image kept as ``failed`` for diagnosis.

        Returns
        -------
        Exception
            What :meth:`checkpoint` raises (``error`` itself, or a
            :class:`CheckpointError` that says what was found and done).
        """
        return error

    async def writing(self, user: str, server_name: str) -> CheckpointInfo | None:
        """The checkpoint of ``user/server_name`` being written right now, if any (a stop
        or start of that server waits for it: :meth:`wait_settled`)."""
        return None

    async def wait_settled(
        self, user: str, server_name: str, timeout: float, interval: float = 0.25
    ) -> CheckpointInfo | None:
        """Wait (at most ``timeout`` s) until no checkpoint of this server is being written.

        Returns
        -------
        CheckpointInfo or None
            The checkpoint still being written when time ran out, else None.
        """
        deadline = time.monotonic() + timeout
        while True:
            pending = await self.writing(user, server_name)
            if pending is None or time.monotonic() > deadline:
                return pending
            await asyncio.sleep(interval)

    # ------------------------------------------------------------------ restore
    async def restore(
        self, info: CheckpointInfo, timeout: float = 600.0, into: RestoreTarget | None = None
    ) -> Restored:
        """Restore a verified checkpoint and return the running server.

        Parameters
        ----------
        info : CheckpointInfo
            A ``verified`` checkpoint of this backend.
        timeout : float
            Seconds the restore may take.
        into : RestoreTarget, optional
            Where to restore, for backends where the caller chooses (Kubernetes: the
            placeholder pod). None where the backend chooses itself.

        Returns
        -------
        Restored
            The restored tree's root pid and, when the backend knows it, its address.

        Raises
        ------
        CheckpointRefused
            Not now, nothing changed (its port still taken, its key missing): the
            checkpoint stays ``verified`` and the next start tries again.
        CheckpointError
            The restore failed and nothing of it is left running; the caller marks the
            checkpoint ``failed`` (:meth:`mark`) and starts afresh.
        """
        raise NotImplementedError

    async def resume_token(self, checkpoint_id: str) -> str:
        """The Hub API token the checkpointed server holds, kept with the checkpoint
        (``""``: none kept; the spawner then does not restore). Raises
        :class:`CheckpointRefused` when it is sealed with a key that is missing now."""
        return ""

    async def kill_tree(self, pids: list[int]) -> None:
        """End a restored process tree the caller will not hand out (it did not answer).

        Backends whose servers run elsewhere (their pods are deleted by the spawner)
        have nothing to do.
        """

    # ------------------------------------------------------------------ records
    async def latest(self, user: str, server_name: str) -> CheckpointInfo | None:
        """The newest verified checkpoint of a server, or None."""
        raise NotImplementedError

    async def get(self, checkpoint_id: str) -> CheckpointInfo | None:
        """One checkpoint by id, or None. Backends that can look one up directly override this."""
        for info in await self.list():
            if info.id == checkpoint_id:
                return info
        return None

    async def list(self, user: str | None = None) -> list[CheckpointInfo]:
        """All checkpoints (of one user, if given), newest first."""
        raise NotImplementedError

    async def mark(self, checkpoint_id: str, status: str, error: str = "") -> None:
        """Record a checkpoint's new status (``failed``, with ``error``, after a failed
        restore; ``restored``). Backends that keep no status after the fact do nothing."""

    async def delete(self, checkpoint_id: str) -> None:
        """Delete one checkpoint."""
        raise NotImplementedError

    def location(self, checkpoint_id: str) -> str:
        """Where an admin finds a checkpoint's files, for messages (``""``: not a place of
        this host)."""
        return ""

    # ------------------------------------------------------------------ retention
    @property
    def retention_days(self) -> float | None:
        """Days a snapshot whose restore failed is kept after the failure: the number
        emails quote ("kept for N days"). None: this backend deletes nothing by age."""
        return None

    async def apply_retention(self) -> list[str]:
        """Delete checkpoints past retention; return their ids. Never the one a restore needs.

        The protocol: :meth:`recover` first (a suspension a crash left under way is
        resolved before anything is judged by its status), then each checkpoint
        :meth:`do_expired` names is deleted (:meth:`do_delete`), then
        :meth:`do_after_retention`. Backends that delete nothing by age name none.
        """
        await self.recover()
        deleted = []
        for cid in await self.do_expired(time.time()):
            await self.do_delete(cid)
            deleted.append(cid)
        await self.do_after_retention()
        return deleted

    async def do_expired(self, now: float) -> list[str]:
        """The ids retention deletes now (the rule: :func:`expired`)."""
        return []

    async def do_delete(self, checkpoint_id: str) -> None:
        """Delete one checkpoint for retention (what it shares with others stays until
        :meth:`do_after_retention`)."""
        await self.delete(checkpoint_id)

    async def do_after_retention(self) -> None:
        """Once retention has deleted what it deletes (local: unused chunks go)."""

    async def scrub(self, full: bool | None = None) -> dict:
        """Re-check stored checkpoint data, repair what can be repaired, and mark the
        checkpoints that can no longer be restored; a report (empty: nothing to do).

        Called periodically (``full=None``: the backend decides whether a full pass is
        due); may run for hours at a bounded I/O rate, so run it as a task of its own.
        Backends whose storage checks itself (a registry, a PVC) keep this no-op.
        """
        return {}

    # ------------------------------------------------------------------ capabilities
    async def park(self, server: Server, unpark: bool = False) -> ParkResult:
        """Park (or unpark) ``server``'s GPU memory where it runs; only when
        :attr:`supports_park`.

        Raises
        ------
        CheckpointRefused
            Declined, nothing changed (GPU busy, host memory short); try again later.
        CheckpointError
            Any other failure.
        """
        raise NotImplementedError(f"{type(self).__name__} does not park (supports_park is False)")

    async def gpu_memory(self, servers: list[Server]) -> GpuReading:
        """Free memory of every GPU the servers run on, and the bytes each of ``servers``
        holds on each; only when :attr:`supports_gpu_memory`. GPUs that cannot be read are
        named in the reading's ``missing``, never raised."""
        raise NotImplementedError(
            f"{type(self).__name__} reads no GPU memory (supports_gpu_memory is False)"
        )

    # ------------------------------------------------------------------ this host
    # What a spawner that runs servers on this host asks of the backend.
    def reserved_ports(self) -> set[int]:
        """Ports held for suspended servers (a restore needs its old port free): a fresh
        server must not take one."""
        return set()

    @property
    def log_root(self) -> str:
        """The folder servers' logs go under (``server_log_template``'s ``{checkpoint_dir}``)."""
        return "/var/log"

    def make_private_dirs(self, path: Path | str) -> None:
        """Create a folder for a server's own files (its log), missing parts 0700."""
        os.makedirs(path, mode=0o700, exist_ok=True)
