"""Kubelet archives the agent keeps on the node after a push that failed on the far side.

When a registry or PVC fails a push with a server-side error (5xx: an outage, a full
volume), the archive the kubelet wrote stays on the node rather than being deleted, so an
admin can still ship or inspect it while the registry is fixed. It stays until the next
checkpoint of the same container ships (:func:`~.ship.sweep_archives` then deletes it), or,
for a container never checkpointed again, until it is older than
``AgentApp.kept_archive_max_age``: the archive holds the server's memory, root-only, and
the kubelet never deletes it.

Each kept archive has a marker file ``<archive name>.kept`` in a folder of its own (on the
agent's restore hostPath, so markers outlive the agent); the marker's modification time is
when the archive was kept, its content the archive's path. Only archives with a marker are
ever swept by age: other archives in the kubelet's folder (an admin's ``kubectl
checkpoint``) are not the agent's.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from .ship import delete_local


class KeptArchives:
    """The markers of kept archives in ``folder``."""

    def __init__(self, folder: Path, log):
        self.folder = Path(folder)
        self.log = log

    def _marker(self, archive: Path) -> Path:
        return self.folder / f"{archive.name}.kept"

    def add(self, archive: Path) -> None:
        """Record that ``archive`` is kept (now)."""
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._marker(archive).write_text(str(archive))

    def forget(self, archives: list[Path]) -> None:
        """Drop the markers of ``archives`` (deleted, or shipped by a later checkpoint)."""
        for archive in archives:
            self._marker(archive).unlink(missing_ok=True)
        self._tidy()

    def kept(self) -> list[Path]:
        """The archives kept now (those whose marker is there)."""
        if not self.folder.is_dir():
            return []
        return [Path(m.read_text().strip()) for m in sorted(self.folder.glob("*.kept"))]

    def sweep(self, max_age: float, now: float | None = None) -> list[Path]:
        """Delete kept archives kept more than ``max_age`` seconds ago (0: none), and the
        markers of archives no longer there. Returns the archives deleted."""
        if not self.folder.is_dir():
            return []
        now = time.time() if now is None else now
        deleted = []
        for marker in sorted(self.folder.glob("*.kept")):
            try:
                archive = Path(marker.read_text().strip())
                age = now - marker.stat().st_mtime
            except OSError as e:
                self.log.warning("unreadable kept-archive marker %s: %s", marker, e)
                continue
            if not archive.exists():
                marker.unlink(missing_ok=True)
            elif max_age > 0 and age > max_age:
                delete_local(archive, self.log)
                marker.unlink(missing_ok=True)
                deleted.append(archive)
                self.log.warning(
                    "deleted checkpoint archive %s, kept on the node after a failed push %.0f "
                    "hour(s) ago: no checkpoint of its container shipped since "
                    "(AgentApp.kept_archive_max_age = %gs)",
                    archive,
                    age / 3600,
                    max_age,
                )
        self._tidy()
        return deleted

    def _tidy(self) -> None:
        with contextlib.suppress(OSError):
            self.folder.rmdir()  # only once empty


__all__ = ["KeptArchives"]
