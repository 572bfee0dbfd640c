"""The contract every checkpoint backend follows (the shape of dask-gateway's backends)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from traitlets.config import LoggingConfigurable

from ..model import Server


class CheckpointError(Exception):
    """A checkpoint or restore failed. The message says what happened and what to do."""


class CheckpointRefused(CheckpointError):
    """The backend will not try (CRIU missing, disk short, GPU busy, …). Nothing was changed.

    ``retry`` is True when the reason is passing (a busy GPU): try again on a later tick.
    """

    def __init__(self, message: str, retry: bool = False):
        super().__init__(message)
        self.retry = retry


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


class CheckpointBackend(LoggingConfigurable):
    """Saves a running server to a verified checkpoint, and restores it.

    A backend never stops a server on its own: :meth:`checkpoint` either returns a
    *verified* checkpoint, after which the server's processes are gone (the caller
    then stops the server through the Hub), or raises and leaves the server running.
    """

    async def setup(self) -> None:
        """Check prerequisites once at start-up (log what is missing)."""

    async def check(self, server: Server) -> None:
        """Raise :class:`CheckpointRefused` if ``server`` cannot be checkpointed now."""

    async def checkpoint(self, server: Server) -> CheckpointInfo:
        """Checkpoint ``server`` (GPU memory, then the process tree), verify it, and return it.

        On success the server's processes no longer run and the GPU is free.
        On any failure, raise :class:`CheckpointError`; the server keeps running.
        """
        raise NotImplementedError

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

    async def delete(self, checkpoint_id: str) -> None:
        """Delete one checkpoint."""
        raise NotImplementedError

    async def apply_retention(self) -> list[str]:
        """Delete checkpoints past retention; return their ids. Never the one a restore needs."""
        return []

    async def scrub(self, full: bool | None = None) -> dict:
        """Re-check stored checkpoint data, repair what can be repaired, and mark the
        checkpoints that can no longer be restored; a report (empty: nothing to do).

        Called periodically (``full=None``: the backend decides whether a full pass is
        due); may run for hours at a bounded I/O rate, so run it as a task of its own.
        Backends whose storage checks itself (a registry, a PVC) keep this no-op.
        """
        return {}
