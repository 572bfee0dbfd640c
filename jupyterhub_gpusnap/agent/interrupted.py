"""The node agent's checkpoints a crash interrupted, resolved by
:meth:`CheckpointBackend.recover() <jupyterhub_gpusnap.checkpoint.base.CheckpointBackend.recover>`,
the crash recovery every backend shares.

While the agent checkpoints a pod it keeps a record of the pids whose GPU memory it froze
(``<restore_dir>/.in-progress/<namespace>_<pod>.json``, on the hostPath: it outlives the
agent). A record left at start-up is a suspension the agent died during. The service
records a checkpoint only once the agent answered, so none is ever completed here: each
is undone (:meth:`InterruptedCheckpoints.do_resume`): the server runs on, so its GPU
memory is resumed, and the half-shipped archive is deleted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint.base import CheckpointBackend, CheckpointError, Suspension
from ..model import Server
from .ship import sweep_archives

if TYPE_CHECKING:
    from .app import AgentApp


@dataclass
class NodeSuspension(Suspension):
    """A checkpoint of a pod's container the agent was taking, from its record."""

    marker: Path = Path()
    namespace: str = ""
    pod: str = ""
    container: str = ""
    pids: list[int] = field(default_factory=list)


class InterruptedCheckpoints(CheckpointBackend):
    """The records of checkpoints under way on this node, as the hooks of
    :meth:`~jupyterhub_gpusnap.checkpoint.base.CheckpointBackend.recover` see them."""

    def __init__(self, agent: AgentApp, **kwargs):
        super().__init__(parent=agent, **kwargs)
        self.agent = agent
        #: the pids whose GPU memory recover() gave back
        self.resumed: list[int] = []

    async def do_unfinished(self) -> list[NodeSuspension]:
        folder = self.agent.in_progress_dir
        found: list[NodeSuspension] = []
        if not folder.is_dir():
            return found
        for marker in sorted(folder.glob("*.json")):
            try:
                record = json.loads(marker.read_text())
                pids = [int(p) for p in record["pids"]]
                ns, name, container = record["namespace"], record["pod"], record["container"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                self.log.error("unreadable checkpoint record %s (%s): left for an admin", marker, e)
                continue
            found.append(
                NodeSuspension(
                    Server(user=ns, name=name),
                    id=f"{ns}/{name}",
                    marker=marker,
                    namespace=ns,
                    pod=name,
                    container=container,
                    pids=pids,
                )
            )
        return found

    async def do_resume(self, s: NodeSuspension, error: Exception) -> Exception:
        """The GPU memory of the record's pids back, the half-shipped archive and the
        record deleted (the record stays when the GPU memory cannot be resumed)."""
        try:
            done = await self.agent.cuda.resume(s.pids)
        except CheckpointError as e:
            self.log.error(
                "%s/%s: GPU memory of an interrupted checkpoint not resumed: %s",
                s.namespace, s.pod, e,
            )  # fmt: skip
            return error
        self.resumed += done
        self.log.warning(
            "%s/%s: the agent stopped during its checkpoint; GPU memory of pids %s resumed, "
            "the server runs on", s.namespace, s.pod, done,
        )  # fmt: skip
        sweep_archives(Path(self.agent.checkpoint_dir), s.namespace, s.pod, s.container, self.log)
        s.marker.unlink(missing_ok=True)
        return error
