"""The node agent's checkpoints as a :class:`~jupyterhub_gpusnap.checkpoint.base.CheckpointBackend`:
a container of a pod on this node, dumped by the kubelet and kept by an
:class:`~.ship.ArchiveStore` (a registry or a PVC).

The base owns the protocol (:meth:`CheckpointBackend.checkpoint()
<jupyterhub_gpusnap.checkpoint.base.CheckpointBackend.checkpoint>`, and its crash recovery,
:meth:`~jupyterhub_gpusnap.checkpoint.base.CheckpointBackend.recover`); :class:`NodeBackend`
supplies the hooks:

- ``do_preflight``: the pod's pids and the GPU memory they hold; refused (409) when they
  hold some and the node has no CUDA checkpoint API.
- ``do_freeze``: their GPU memory to host memory, and a record of the pids frozen
  (``<restore_dir>/.in-progress/<namespace>_<pod>.json``, on the hostPath: it outlives
  the agent).
- ``do_dump``: the kubelet's checkpoint of the container (an archive in its folder).
- ``do_verify``: the archive shipped to the store and verified there by digest.
- ``do_record``: the shipped checkpoint (the service records it once the agent answers).
- ``do_end``: the record and the node's archive deleted (the kubelet never cleans them),
  with those of the container a timed-out kubelet call left.
- ``do_resume``: the GPU memory back, the container runs on; the archive deleted, or kept
  on the node when the store failed on its side (5xx; see :mod:`.kept`).

A record left at start-up is a suspension the agent died during (``do_unfinished``). The
service records a checkpoint only once the agent answered, so none is ever completed:
each is undone (``do_resume`` in phase ``recover``): its GPU memory is resumed, the
half-shipped archive and the record deleted.

:meth:`NodeBackend.restore` is the base's one restore, ``restore(info, timeout,
into=RestoreTarget(namespace, pod, container)) -> Restored``: into the placeholder pod's
container (its steps in :mod:`.restore_into`), or with ``AgentApp.restore_into = 'agent'``
into the agent's own namespaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint import criu as criu_tools
from ..checkpoint.base import (
    CheckpointBackend,
    CheckpointError,
    CheckpointInfo,
    Restored,
    RestoreTarget,
    Suspension,
)
from ..gpu.compat import GpuNeeds
from ..kube.errors import AgentError
from ..model import Server
from .container_archive import ContainerArchive
from .restore_into import check_gpus, children, criu_into, find_placeholder, keep_only_logs
from .ship import ArchiveStore, Shipped, delete_local, remove_tree, sweep_archives

if TYPE_CHECKING:
    from .app import AgentApp


@dataclass
class NodeSuspension(Suspension):
    """A checkpoint of a pod's container on this node: under way, or found from its record
    after a crash (then only ``namespace`` to ``marker`` are known)."""

    namespace: str = ""
    pod: str = ""
    container: str = ""
    #: the pids whose GPU memory was frozen
    pids: list[int] = field(default_factory=list)
    #: the record of those pids, while they are frozen
    marker: Path | None = None
    timeout: int = 0
    store: ArchiveStore | None = None
    #: NVML's ``{device: {pid: bytes}}`` of the container's pids, before the freeze
    held: dict[int, dict[int, int]] = field(default_factory=dict)
    gpu: GpuNeeds = field(default_factory=GpuNeeds)
    archive: Path | None = None
    created: float = 0.0
    #: the archive stays on the node: its push failed on the store's side
    keep: bool = False
    shipped: Shipped | None = None

    @property
    def gpu_pids(self) -> list[int]:
        """The container's pids that hold GPU memory."""
        return sorted({p for d in self.held.values() for p in d})

    @property
    def gpu_bytes(self) -> int:
        return sum(sum(d.values()) for d in self.held.values())

    @property
    def where(self) -> str:
        return f"{self.namespace}/{self.pod}"


class NodeBackend(CheckpointBackend):
    """Checkpoints of this node's containers: the kubelet dumps, an
    :class:`~.ship.ArchiveStore` keeps. ``checkpoint(server, pod=…, container=…,
    timeout=…, store=…)``; ``recover()`` at the agent's start; ``restore(info, timeout,
    into=RestoreTarget(namespace, pod, container))``.

    The agent keeps no list of checkpoints: the service's
    :class:`~jupyterhub_gpusnap.checkpoint.kubernetes.KubernetesBackend` records them
    (from the agent's answers) and deletes them. :meth:`latest`, :meth:`list` (and so
    :meth:`get`) and :meth:`delete` raise :class:`CheckpointError` saying so.
    """

    #: a cancelled request gives its pod's GPU memory back too
    undo_on = (BaseException,)

    def __init__(self, agent: AgentApp, **kwargs):
        super().__init__(parent=agent, **kwargs)
        self.agent = agent
        #: the pids whose GPU memory recover() gave back
        self.resumed: list[int] = []

    @property
    def in_progress_dir(self) -> Path:
        return self.agent.in_progress_dir

    def mark_in_progress(self, ns: str, name: str, container: str, pids: list[int]) -> Path | None:
        """Record the pids whose GPU memory a checkpoint froze, until it ends either way."""
        if not pids:
            return None
        self.in_progress_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        marker = self.in_progress_dir / f"{ns}_{name}.json"
        record = {
            "namespace": ns,
            "pod": name,
            "container": container,
            "pids": pids,
            "started": time.time(),
        }
        marker.write_text(json.dumps(record))
        return marker

    # -- checkpoint() -----------------------------------------------------------------

    async def do_preflight(
        self, server: Server, *, pod: dict, container: str, timeout: int, store: ArchiveStore
    ) -> NodeSuspension:
        """The container's pids and the GPU memory they hold; 409 when they hold some and
        the CUDA checkpoint API is missing."""
        agent = self.agent
        s = NodeSuspension(
            server,
            namespace=pod["metadata"]["namespace"],
            pod=pod["metadata"]["name"],
            container=container,
            timeout=timeout,
            store=store,
        )
        pids = await agent.container_pids(pod, container)
        s.held = await asyncio.to_thread(agent.nvml.process_memory, pids) if pids else {}
        if s.gpu_pids and not await asyncio.to_thread(agent.cuda.available):
            raise AgentError(
                f"{server.key}: pids {s.gpu_pids} hold GPU memory but the CUDA checkpoint API "
                f"is unavailable ({agent.cuda.reason})",
                "upgrade the node's NVIDIA driver to 570 or newer",
                409,
            )
        return s

    async def do_freeze(self, s: NodeSuspension) -> None:
        """GPU memory to host memory (all or nothing), and its record."""
        s.pids = await self.agent.cuda.suspend(s.gpu_pids) if s.gpu_pids else []
        s.marker = self.mark_in_progress(s.namespace, s.pod, s.container, s.pids)
        s.gpu = await asyncio.to_thread(self._gpu_needs, s.held, s.pids)

    def _gpu_needs(self, held: dict[int, dict[int, int]], suspended: list[int]) -> GpuNeeds:
        """What restoring the GPU memory of ``suspended`` needs: the model of the GPUs they
        held memory on (``held``: NVML's ``{device: {pid: bytes}}``), those devices and
        the driver. Blocking (NVML)."""
        if not suspended:
            return GpuNeeds()
        nvml = self.agent.nvml
        mine = set(suspended)
        devices = sorted(d for d, procs in held.items() if mine & set(procs))
        names = nvml.device_names()
        first = devices[0] if devices else 0
        return GpuNeeds(
            holds_gpu=True,
            model=names[first] if first < len(names) else "",
            devices=devices,
            driver_version=nvml.driver_version() or self.agent.cuda.driver_version() or "",
        )

    async def do_dump(self, s: NodeSuspension) -> None:
        """The kubelet's checkpoint of the container, as the agent sees its archive."""
        agent = self.agent
        path = await agent.kubelet.checkpoint(
            agent.node_name, s.namespace, s.pod, s.container, s.timeout
        )
        s.archive = Path(agent.checkpoint_dir) / Path(path).name
        if not s.archive.exists():
            raise AgentError(
                f"the kubelet wrote {path} but the agent cannot see {s.archive}",
                "mount the host's /var/lib/kubelet/checkpoints at checkpoint_dir",
                500,
            )
        s.created = time.time()

    async def do_verify(self, s: NodeSuspension) -> None:
        """The archive shipped and verified by digest; a failure on the store's side (5xx)
        keeps it on the node."""
        try:
            s.shipped = await s.store.ship(
                s.archive,
                server=s.server.key,
                container=s.container,
                gpu_bytes=s.gpu_bytes,
                created=s.created,
                gpu=s.gpu,
            )
        except AgentError as e:
            s.keep = e.code >= 500  # the registry's or volume's fault, not the request's
            raise

    async def do_record(self, s: NodeSuspension) -> CheckpointInfo:
        shipped = s.shipped
        return CheckpointInfo(
            id=shipped.id,
            user=s.server.user,
            server_name=s.server.name,
            created=s.created,
            status="verified",
            image_bytes=shipped.image_bytes,
            gpu_bytes=s.gpu_bytes,
            location=shipped.location,
            extra={"digest": shipped.digest, "gpu": s.gpu.as_dict(), "node": self.agent.node_name},
        )

    async def do_end(self, s: NodeSuspension, info: CheckpointInfo) -> None:
        """The record and the node's archives gone; the container's processes end when the
        Hub stops the server."""
        self._tidy(s)
        self.log.info(
            "checkpoint of %s (pod %s) verified as %s (%d bytes, %d GPU bytes) in %.1fs",
            s.server.key,
            s.where,
            info.id,
            info.image_bytes,
            info.gpu_bytes,
            time.monotonic() - s.started,
        )

    async def do_resume(self, s: NodeSuspension, error: BaseException) -> BaseException:
        """The GPU memory back, the archive deleted or kept (:meth:`_tidy`); the error as
        it was. In crash recovery: :meth:`_undo_interrupted`."""
        if s.phase == "recover":
            return await self._undo_interrupted(s, error)
        if s.phase == "freeze" and not s.pids:
            return error  # the driver rolled the freeze back: nothing changed
        try:
            if s.pids:
                await self.agent.cuda.resume(s.pids)
            self.log.warning(
                "checkpoint of %s (pod %s) failed, it keeps running: %s",
                s.server.key,
                s.where,
                error,
            )
        finally:
            self._tidy(s)
        return error

    def _tidy(self, s: NodeSuspension) -> None:
        """Once a checkpoint ended either way: its record deleted; the node's archive
        deleted, or kept when its push failed on the store's side; the container's older
        archives swept."""
        agent = self.agent
        if s.marker is not None:
            s.marker.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                s.marker.parent.rmdir()  # only once no other checkpoint is under way
        if s.keep:
            self.log.warning(
                "%s: the checkpoint archive %s stays on the node until a checkpoint of "
                "%s/%s/%s ships (at most AgentApp.kept_archive_max_age = %gs)",
                s.server.key, s.archive, s.namespace, s.pod, s.container, agent.kept_archive_max_age,
            )  # fmt: skip
            agent.kept_archives.add(s.archive)
        elif s.archive is not None:
            delete_local(s.archive, self.log)
        # archives a timed-out kubelet call finished writing later, and one kept after
        # an earlier failed push (at most one per container is kept)
        removed = sweep_archives(
            Path(agent.checkpoint_dir), s.namespace, s.pod, s.container, self.log,
            keep=s.archive if s.keep else None,
        )  # fmt: skip
        agent.kept_archives.forget(removed + ([] if s.keep or s.archive is None else [s.archive]))

    # -- recover() --------------------------------------------------------------------

    async def do_unfinished(self) -> list[NodeSuspension]:
        folder = self.in_progress_dir
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

    async def _undo_interrupted(self, s: NodeSuspension, error: Exception) -> Exception:
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

    # -- restore() --------------------------------------------------------------------

    async def restore(
        self, info: CheckpointInfo, timeout: float = 600.0, into: RestoreTarget | None = None
    ) -> Restored:
        """Fetch checkpoint ``info.id`` (an image reference or a PVC archive) and restore it
        into ``into``'s container (empty: the pod's only one), ``criu restore`` stopped
        after ``timeout`` seconds; its GPU memory resumed.

        Returns
        -------
        Restored
            The restored tree's root pid on this node; with a placeholder, ``detail`` has
            its ``placeholder_pid``, ``namespaces`` and ``cgroup``.

        Raises
        ------
        AgentError
            409 when not now or not here, nothing changed (the placeholder not running or
            not this checkpoint's, GPUs or driver that cannot take its GPU memory); 500 for
            a restore that failed. The unpacked checkpoint is deleted, CRIU's logs kept.
        """
        if into is None:
            raise CheckpointError(
                f"{info.id}: the node agent restores into a pod: name it "
                "(into=RestoreTarget(namespace, pod, container))"
            )
        agent = self.agent
        image, key = info.id, f"{into.namespace}/{into.pod}"
        scratch = (
            Path(agent.restore_dir) / hashlib.sha256(f"{key}@{image}".encode()).hexdigest()[:16]
        )
        try:
            started = time.monotonic()
            target = (
                await find_placeholder(agent, into.namespace, into.pod, into.container, image)
                if agent.restore_into == "placeholder"
                else None
            )
            await check_gpus(agent, image)
            if not criu_tools.find_criu(agent.criu_path):
                raise AgentError(
                    f"CRIU not found at {agent.criu_path}",
                    "install CRIU >= 4.2 in the agent image and set AgentApp.criu_path",
                    500,
                )
            images = await agent.shipper.for_image(image).fetch(image, scratch)
            extra = list(agent.criu_restore_args)
            try:
                if target is not None:
                    restored = await criu_into(agent, target, images, scratch, extra, timeout)
                else:
                    if (await asyncio.to_thread(ContainerArchive.read, images)).spec.get("root"):
                        raise AgentError(
                            f"checkpoint {image} is a container's (its runtime's archive has "
                            "the container's spec): it can only be restored into a container",
                            "set AgentApp.restore_into = 'placeholder' (the default) and restore "
                            "into the placeholder pod SnapKubeSpawner creates",
                            409,
                        )
                    if agent.restore_root:
                        extra += ["--root", agent.restore_root]
                    restored = await criu_tools.restore(
                        images,
                        scratch / "restore.pid",
                        criu=agent.criu_path,
                        extra=extra,
                        timeout=timeout,
                    )
            except CheckpointError as e:
                raise AgentError(
                    f"criu restore of {image} failed: {e}",
                    "a PID or port of the checkpoint is taken on this node, or files it had open "
                    "are missing; the image is kept: free them and restore again",
                    500,
                ) from e
            # criu stays the restored tree's parent and reaps it; the agent keeps its handle
            agent._restored = [r for r in agent._restored if r.reap() is None] + [restored]
            pid = restored.pid
            tree = [pid, *(c.pid for c in children(pid))]
            detail: dict = {}
            if target is not None:
                moved = await asyncio.to_thread(target.adopt, tree)
                if moved:
                    self.log.warning(
                        "restore into pod %s: pids %s were outside %s, moved in",
                        key,
                        moved,
                        target.cgroup,
                    )
                detail.update(
                    placeholder_pid=target.pid,
                    namespaces=target.namespaces,
                    cgroup="/" + str(target.cgroup.relative_to(agent.mapper.cgroup_root)),
                )
            resumed = await agent.cuda.resume(tree)
            self.log.info(
                "restored %s into pod %s as pid %d (%s, GPU pids %s) in %.1fs",
                image,
                key,
                pid,
                f"placeholder pid {target.pid}" if target else "agent namespaces",
                resumed,
                time.monotonic() - started,
            )
            remove_tree(scratch)
            return Restored(pid=pid, node=agent.node_name, detail=detail)
        except BaseException:
            # the unpacked checkpoint holds the server's memory (and may be GiBs): gone at
            # once; CRIU's log stays for the error message that names it
            await asyncio.to_thread(keep_only_logs, scratch)
            raise

    # -- records: the service's ----------------------------------------------------------

    def _no_records(self) -> CheckpointError:
        return CheckpointError(
            f"the node agent on {self.agent.node_name or 'this node'} keeps no list of "
            "checkpoints: ask the service's KubernetesBackend, which records them"
        )

    async def latest(self, user: str, server_name: str) -> CheckpointInfo | None:
        raise self._no_records()

    async def list(self, user: str | None = None) -> list[CheckpointInfo]:
        raise self._no_records()

    async def delete(self, checkpoint_id: str) -> None:
        raise self._no_records()
