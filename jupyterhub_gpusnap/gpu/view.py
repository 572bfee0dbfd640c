"""Free memory per GPU and who holds it: the one view make-room works over.

Make-room (the admin API and ``Watcher.min_free_gpu_memory``) needs, per GPU, its free
memory and the bytes each server holds on it. On one machine the service reads them from
NVML itself (servers by their process trees); on Kubernetes, where the service has no
GPU, every node agent reads them for its node (``GET /v1/gpus``, pods by their cgroups)
and :meth:`~jupyterhub_gpusnap.checkpoint.kubernetes.KubernetesBackend.gpu_memory`
gathers them. Both end as :class:`GpuView` records, so the watcher has one code path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..model import Server
from ..procs import tree_pids


@dataclass
class GpuView:
    """One GPU of one node: its memory and the bytes each server holds on it.

    ``node`` is the Kubernetes node name, or ``""`` for the GPUs of the machine the
    service runs on; ``index`` is the device index as nvidia-smi numbers it on that
    node; ``held`` maps server keys (``user/name``) to their bytes on this GPU, for the
    servers asked about only.
    """

    node: str
    index: int
    free_bytes: int
    total_bytes: int = 0
    held: dict[str, int] = field(default_factory=dict)
    uuid: str = ""
    can_park: bool = True  # False: the node has no CUDA checkpoint API (driver < 570)

    @property
    def label(self) -> str:
        """How logs and reasons name this GPU: ``GPU 0`` or ``GPU 0 of node gpu-node-1``."""
        return f"GPU {self.index}" + (f" of node {self.node}" if self.node else "")


@dataclass
class GpuReading:
    """The GPUs that could be read, and why others could not (``missing``: place → reason;
    the place is a node name, ``""`` for this machine or the cluster as a whole)."""

    gpus: list[GpuView] = field(default_factory=list)
    missing: dict[str, str] = field(default_factory=dict)

    def why_none(self) -> str:
        """Why no GPU could be read, for a log line."""
        if not self.missing:
            return "no GPU"
        return "; ".join(f"node {k}: {v}" if k else v for k, v in sorted(self.missing.items()))


class RoomRequestError(ValueError):
    """A make-room request that names no GPU unambiguously; the message says what to send."""


def read_devices(nvml: Any, owners: dict[str, list[int]], node: str = "") -> list[GpuView]:
    """Every GPU NVML sees, with the bytes each owner's pids hold on it. Blocking (NVML).

    ``owners`` maps a name (a server key, or ``namespace/pod`` on the agent) to its
    pids. A few NVML calls per device (memory, UUID, processes), however many owners
    there are. ``[]`` without NVML.
    """
    if not nvml.open():
        return []
    total = nvml.device_memory_total()
    free = nvml.device_memory_free()
    owners_of: dict[int, list[str]] = {}  # a pid in two owners' trees counts for both
    for name, pids in owners.items():
        for pid in pids:
            owners_of.setdefault(pid, []).append(name)
    per_device = nvml.process_memory(list(owners_of))
    uuids = nvml.device_uuids()
    views = []
    for index, have in enumerate(free):
        held: dict[str, int] = {}
        for pid, nbytes in per_device.get(index, {}).items():
            for name in owners_of[pid]:
                if nbytes:
                    held[name] = held.get(name, 0) + nbytes
        views.append(
            GpuView(
                node=node,
                index=index,
                free_bytes=have,
                total_bytes=total[index],
                held=held,
                uuid=uuids[index],
            )
        )
    return views


def local_gpus(nvml: Any, servers: list[Server]) -> list[GpuView]:
    """This machine's GPUs, with the bytes each of ``servers`` (by process tree) holds.
    Blocking (NVML and /proc): call in a thread."""
    owners = {s.key: tree_pids(s.pid) for s in servers if s.pid}
    return read_devices(nvml, owners)


def agent_payload(view: GpuView) -> dict:
    """One GPU as the agent's ``GET /v1/gpus`` sends it (``pods``: ``namespace/pod`` → bytes)."""
    out: dict = {"index": view.index}
    if view.uuid:
        out["uuid"] = view.uuid
    out.update(total_bytes=view.total_bytes, free_bytes=view.free_bytes, pods=dict(view.held))
    return out


def from_agent(node: str, payload: dict, server_of_pod: dict[str, str]) -> list[GpuView]:
    """An agent's ``GET /v1/gpus`` answer as views of ``node``'s GPUs; pods are turned into
    server keys through ``server_of_pod`` (``namespace/pod`` → ``user/name``), other pods
    (not a server asked about) are left out."""
    can_park = bool(payload.get("checkpoint_api", True))
    views = []
    for gpu in payload.get("gpus") or []:
        held: dict[str, int] = {}
        for pod, nbytes in (gpu.get("pods") or {}).items():
            key = server_of_pod.get(pod)
            if key is not None and nbytes:
                held[key] = held.get(key, 0) + int(nbytes)
        views.append(
            GpuView(
                node=node,
                index=int(gpu["index"]),
                free_bytes=int(gpu["free_bytes"]),
                total_bytes=int(gpu.get("total_bytes") or 0),
                held=held,
                uuid=str(gpu.get("uuid") or ""),
                can_park=can_park,
            )
        )
    return views


def pick(gpus: list[GpuView], gpu: int | None, node: str | None) -> list[GpuView]:
    """The GPUs a make-room request names: ``gpu`` (an index) on ``node``.

    Without ``node`` the index must be unambiguous: on a hub with GPUs on more than one
    node, :class:`RoomRequestError` names the nodes to choose from. A ``node`` that has no
    GPU in the view is an error too (a typo would otherwise park nothing and say
    "not enough"). An index no GPU has matches nothing (as on a host without NVML).
    """
    nodes = sorted({g.node for g in gpus})
    if node is None:
        if gpu is not None and len(nodes) > 1:
            raise RoomRequestError(
                f"this hub has GPUs on {len(nodes)} nodes ({', '.join(nodes)}): say which node's "
                f'GPU {gpu}, e.g. {{"gpu": {gpu}, "node": "{nodes[0]}"}}'
            )
        return [g for g in gpus if gpu is None or g.index == gpu]
    if node not in nodes:
        seen = ", ".join(n or '"" (this machine)' for n in nodes) or "none"
        raise RoomRequestError(
            f"no GPU of node {node!r} is known (GPU nodes with a node agent: {seen}); "
            "send the node name as kubectl get nodes shows it, or leave 'node' out on a single machine"
        )
    return [g for g in gpus if g.node == node and (gpu is None or g.index == gpu)]
