"""What :meth:`NodeBackend.restore() <.node_backend.NodeBackend.restore>` does before and
around ``criu restore``: find the placeholder pod's process, refuse a checkpoint this
node's GPUs cannot take, put the container archive's file changes and the restored tree
into the placeholder (see :mod:`.placeholder`), and clean the scratch folder after a
failure.

Each is a step of the restore; the agent's settings (``AgentApp.restore_*``,
``runtime_state_dirs``, ``host_root``, ``criu_path``) come from ``agent``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from ..checkpoint import criu as criu_tools
from ..gpu.compat import GpuNeeds, gpu_difference
from ..gpu.nvml import Nvml
from ..kube.errors import AgentError
from .container_archive import ContainerArchive, apply_rootfs_diff
from .placeholder import PLACEHOLDER_ANNOTATION, Placeholder, pick_root
from .pods import container_id
from .runtime_state import find_state

if TYPE_CHECKING:
    from .app import AgentApp


async def find_placeholder(
    agent: AgentApp, namespace: str, name: str, container: str, image: str = ""
) -> Placeholder:
    """The running process of ``container`` in placeholder pod ``namespace/name``.

    Raises a 409 AgentError when the pod is not a placeholder for ``image``, while it is
    elsewhere, its container is not running or none of its processes is visible (the
    caller retries or starts a fresh server).
    """
    key = f"{namespace}/{name}"
    pod = await agent.pod_on_node(namespace, name)
    waits_for = (pod["metadata"].get("annotations") or {}).get(PLACEHOLDER_ANNOTATION)
    if agent.restore_requires_placeholder and waits_for != image:
        raise AgentError(
            f"pod {key} is not a placeholder for {image} "
            f"({PLACEHOLDER_ANNOTATION}: {waits_for or '(none)'})",
            "restore into the placeholder pod SnapKubeSpawner created for this checkpoint",
            409,
        )
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    if not container and len(statuses) == 1:
        container = statuses[0].get("name", "")
    status = next((s for s in statuses if s.get("name") == container), None)
    if (
        status is None
        or not status.get("containerID")
        or "running" not in (status.get("state") or {})
    ):
        raise AgentError(
            f"container {container or '(none named)'} of placeholder pod {key} is not running",
            "wait until the placeholder pod is Running (its container runs "
            "SnapKubeSpawner.placeholder_command) and name it in 'container'",
            409,
        )
    procs = (await asyncio.to_thread(agent.mapper.scan)).get(pod["metadata"]["uid"])
    pids = procs.containers.get(container_id(status["containerID"]), []) if procs else []
    root = await asyncio.to_thread(pick_root, pids, agent.mapper.proc_root) if pids else None
    if root is None:
        raise AgentError(
            f"no process of container {container} (pod {key}) is visible on node {agent.node_name}",
            "run the agent with hostPID: true, the host's /proc at PodMapper.proc_root and "
            "the host's cgroup v2 hierarchy at PodMapper.cgroup_root",
            409,
        )
    runtime = await asyncio.to_thread(
        find_state,
        container_id(status["containerID"]),
        list(agent.runtime_state_dirs),
        agent.host_root,
    )
    target = await asyncio.to_thread(
        Placeholder.of,
        root,
        agent.mapper.proc_root,
        agent.mapper.cgroup_root,
        list(agent.restore_join_namespaces),
        runtime,
    )
    if not os.access(target.cgroup / "cgroup.procs", os.W_OK):
        raise AgentError(
            f"cannot write {target.cgroup / 'cgroup.procs'} (cgroup of pod {key})",
            "mount the host's /sys/fs/cgroup read-write at PodMapper.cgroup_root and run "
            "the agent privileged",
            500,
        )
    return target


def gpus_here(nvml: Nvml) -> dict:
    """This node's GPUs as :func:`~jupyterhub_gpusnap.gpu.compat.gpu_difference`
    reads them (``gpu_model``, ``gpu_count``, ``driver_version``; ``error`` without
    NVML). Blocking (NVML)."""
    try:
        if not nvml.open():
            return {"gpu_count": 0, "error": nvml.reason or "NVML unavailable"}
        names = nvml.device_names()
        return {
            "gpu_model": names[0] if names else "",
            "gpu_count": len(names),
            "driver_version": nvml.driver_version() or "",
        }
    except Exception as e:  # an NVML error: treat as no usable GPU, say why
        return {"gpu_count": 0, "error": f"{type(e).__name__}: {e}"}


async def check_gpus(agent: AgentApp, image: str) -> GpuNeeds | None:
    """Refuse (409) a checkpoint whose GPU memory this node cannot restore.

    Reads what ``image`` records (its manifest annotations or PVC record, not the
    archive) and compares it with this node's GPU model, count and driver, before
    anything is fetched or CRIU runs: a GPU checkpoint restored elsewhere fails only
    after CRIU has rebuilt the tree. Returns the needs (None: the image records none).
    """
    needs = await agent.shipper.for_image(image).gpu_needs(image)
    if needs is None:
        agent.log.info(
            "checkpoint %s records no GPU model or driver (taken by an older agent); "
            "restoring it without the GPU check",
            image,
        )
        return None
    if not needs.holds_gpu:
        return needs
    here = await asyncio.to_thread(gpus_here, agent.nvml)
    why, fix = gpu_difference(needs, here, "node")
    if why:
        raise AgentError(
            f"checkpoint {image} cannot be restored on node {agent.node_name}: {why}",
            fix,
            409,
        )
    if not await asyncio.to_thread(agent.cuda.available):
        raise AgentError(
            f"checkpoint {image} holds GPU memory but node {agent.node_name} has no CUDA "
            f"checkpoint API ({agent.cuda.reason})",
            "expose libcuda.so.1 of NVIDIA driver "
            f"{needs.driver_version or '>= 570'} to the agent (runtimeClass nvidia)",
            409,
        )
    return needs


async def criu_into(
    agent: AgentApp,
    target: Placeholder,
    images: Path,
    scratch: Path,
    extra: list[str],
    timeout: float,
):
    """Restore the container archive around ``images`` into the placeholder ``target``:
    its file changes into the placeholder's root filesystem, then CRIU with the
    placeholder's root, volumes, network namespace and stdio (see :mod:`.placeholder`)."""
    archive = await asyncio.to_thread(ContainerArchive.read, images)
    args, inherit = target.restore_args(archive)
    if target.runtime is not None:
        written = await asyncio.to_thread(apply_rootfs_diff, archive, target.rootfs)
        agent.log.info("applied %d changed files of the checkpoint to %s", written, target.rootfs)
    elif _has_rootfs_changes(archive):
        raise AgentError(
            "the checkpoint carries file changes (rootfs-diff.tar) but the agent found no "
            "runtime state of the placeholder container to apply them to",
            "point AgentApp.runtime_state_dirs at the container runtime's state folder "
            "(CRI-O with runc: /run/runc; containerd: /run/containerd/runc/k8s.io)",
            409,
        )
    return await criu_tools.restore(
        images,
        scratch / "restore.pid",
        criu=agent.criu_path,
        extra=extra + args,
        inherit=inherit,
        cgroup=target.cgroup,
        timeout=timeout,
    )


def keep_only_logs(folder: Path) -> None:
    """Delete everything under ``folder`` but CRIU's restore logs (``restore-*.log``) and the
    folders holding them."""
    if not folder.is_dir():
        return
    for path in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        try:
            if path.is_dir() and not path.is_symlink():
                path.rmdir()  # only when empty: folders with a log stay
            elif not (path.name.startswith("restore-") and path.name.endswith(".log")):
                path.unlink()
        except OSError:
            continue
    with contextlib.suppress(OSError):
        folder.rmdir()


def _has_rootfs_changes(archive: ContainerArchive) -> bool:
    diff = archive.folder / "rootfs-diff.tar"
    if archive.deleted_files():
        return True
    try:
        with tarfile.open(diff, "r:") as tar:
            return tar.next() is not None
    except (OSError, tarfile.TarError):
        return False


def children(pid: int) -> list[psutil.Process]:
    """The processes under ``pid`` (none when it is gone)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
