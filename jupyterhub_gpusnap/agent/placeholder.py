"""Restoring into a placeholder pod: find its container's process and put the restored tree there.

A GPU pod is restored into a *placeholder*: a pod with the checkpoint's image and GPU
request whose container only waits (``sleep infinity``). The agent finds that
container's first process on the node (host PIDs → pods through ``/proc/<pid>/cgroup``,
see :mod:`.pods`), the container's root filesystem and volumes on the node (its runtime's
state, see :mod:`.runtime_state`), and runs ``criu restore`` so that the restored tree

- sees the placeholder's root filesystem (``--root``, the node's path of it), with the
  checkpointed container's own file changes put back first (``rootfs-diff.tar``);
- has the placeholder's volumes at the places the checkpointed container had its bind
  mounts (``--external mnt[<destination>]:<the placeholder's source>``), so the same
  PVC (the user's home) is where the server left its open files; masked files are
  ``/dev/null`` again;
- joins the pod's network namespace: as a pod's container it had joined its sandbox's,
  which runc records as external ``extRootNetNS``; the agent hands CRIU the placeholder's
  (``--inherit-fd fd[N]:extRootNetNS``), so the server answers on the pod IP the Hub and
  proxy know. IPC and UTS: ``--join-ns ipc:/proc/<pid>/ns/ipc`` (and ``uts``);
- writes to the placeholder's stdout and stderr (``--inherit-fd`` of the placeholder's
  pipes for the ``pipe:[…]`` stdio the archive lists): ``kubectl logs`` shows the
  restored server;
- lives in the container's cgroup, so the pod's memory/CPU limits apply, its memory is
  charged to the pod, and deleting the pod stops it. ``criu restore`` itself is started
  inside that cgroup (like runc does for container restores), so every restored task
  is born there; ``--manage-cgroups=ignore`` keeps CRIU from recreating the checkpointed
  container's old cgroup paths. Any task found outside afterwards is moved in.

CRIU cannot join a PID namespace: the restored tree gets a PID namespace of its own
(the server is PID 1 there again, as in its old container) and does not show in
``kubectl exec … ps`` of the placeholder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..kube.errors import AgentError
from .container_archive import MASK_KEY, NET_KEY, ContainerArchive
from .runtime_state import RuntimeState

#: Pod annotation SnapKubeSpawner puts on a placeholder pod: the checkpoint it waits for.
#: The agent restores only into a pod that carries it with the image being restored.
PLACEHOLDER_ANNOTATION = "gpusnap.jupyter.org/placeholder-for"

#: Namespaces ``criu restore --join-ns`` can join for a placeholder (CRIU 4.2 refuses
#: ``pid``; the mount namespace is rebuilt from the image on ``--root``).
JOINABLE_NAMESPACES = ("net", "ipc", "uts")


def cgroup_v2_path(text: str) -> str | None:
    """The unified-hierarchy path (``0::/…`` line) of a ``/proc/<pid>/cgroup``, or None."""
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return None


def resolve_cgroup(cgroup_root: str, path: str) -> Path:
    """The directory of cgroup ``path`` under ``cgroup_root``.

    A process in a private cgroup namespace (the agent's own container) sees other
    cgroups as ``/../../kubepods.slice/…``; the host hierarchy mounted at ``cgroup_root``
    is searched for the path without its ``..`` part.
    """
    root = Path(cgroup_root)
    parts = [p for p in path.split("/") if p and p != "."]
    direct = root.joinpath(*parts) if parts else root
    if ".." not in parts and direct.is_dir():
        return direct
    tail = [p for p in parts if p != ".."]
    if not tail:
        return root
    for folder, dirs, _ in os.walk(root):
        here = Path(folder)
        if here.name == tail[-1] and here.parts[-len(tail) :] == tuple(tail):
            return here
        if len(here.relative_to(root).parts) >= 8:
            dirs.clear()
    raise AgentError(
        f"cgroup {path} is not under {cgroup_root}",
        "mount the host's /sys/fs/cgroup (cgroup v2) read-write at PodMapper.cgroup_root",
        500,
    )


def pick_root(pids: list[int], proc_root: str) -> int | None:
    """The container's first process: the lowest PID whose parent is outside ``pids``."""
    inside = set(pids)
    for pid in sorted(pids):
        try:
            stat = (Path(proc_root) / str(pid) / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid not in inside:
            return pid
    return None


@dataclass
class Placeholder:
    """The placeholder container's first process, as the agent sees it."""

    pid: int
    proc_root: str
    cgroup: Path  # the container's cgroup directory under PodMapper.cgroup_root
    namespaces: dict[str, str] = field(default_factory=dict)  # "net" -> "net:[4026…]"
    runtime: RuntimeState | None = None  # its runtime's record: root filesystem, volumes
    own_mount_ns: bool = False  # in a mount namespace other than the agent's

    @classmethod
    def of(
        cls,
        pid: int,
        proc_root: str,
        cgroup_root: str,
        join: list[str],
        runtime: RuntimeState | None = None,
    ) -> Placeholder:
        """Read the process's cgroup and namespaces; AgentError if it is gone or unreadable."""
        proc = Path(proc_root) / str(pid)
        try:
            path = cgroup_v2_path((proc / "cgroup").read_text())
            namespaces = {ns: os.readlink(proc / "ns" / ns) for ns in join}
            own_mnt = os.readlink(proc / "ns" / "mnt") != os.readlink("/proc/self/ns/mnt")
        except OSError as e:
            raise AgentError(
                f"cannot read process {pid} of the placeholder: {e}",
                "run the agent privileged with hostPID: true and the host's /proc at "
                "PodMapper.proc_root",
                500,
            ) from e
        if path is None:
            raise AgentError(
                f"process {pid} of the placeholder has no cgroup v2 path",
                "GPU restores need nodes with the unified cgroup hierarchy (cgroup v2)",
                500,
            )
        return cls(pid, proc_root, resolve_cgroup(cgroup_root, path), namespaces, runtime, own_mnt)

    @property
    def rootfs(self) -> Path:
        """The placeholder's root filesystem as the agent (and CRIU) can bind mount it."""
        if self.runtime is not None:
            return self.runtime.rootfs
        root = Path(self.proc_root) / str(self.pid) / "root"
        # a process in the agent's own mount namespace and root: CRIU takes "/" (a path
        # through /proc/<pid>/root cannot be mounted from the tree's new mount namespace)
        if not self.own_mount_ns and os.path.samefile(root, "/"):
            return Path("/")
        return root

    def restore_args(self, archive: ContainerArchive) -> tuple[list[str], list[tuple[str, str]]]:
        """``criu restore`` arguments for ``archive`` into this container, and the files to
        hand CRIU as inherited fds: ``(path to open, CRIU key)``, the caller opens each and
        passes ``--inherit-fd fd[N]:key``.

        Raises a 409 AgentError when the placeholder cannot take the archive: it runs in
        a mount namespace of its own and its runtime's state is unknown (CRIU cannot bind
        mount across mount namespaces), or it lacks a volume the checkpointed container
        had (files open there would be missing).
        """
        if self.runtime is None and self.own_mount_ns:
            raise AgentError(
                f"the placeholder's process {self.pid} runs in its own mount namespace and "
                "the agent found no runtime state for its container",
                "point AgentApp.runtime_state_dirs at the container runtime's state folder "
                "(CRI-O with runc: /run/runc; containerd: /run/containerd/runc/k8s.io) and "
                "make the node's paths visible to the agent (AgentApp.host_root)",
                409,
            )
        proc = Path(self.proc_root) / str(self.pid)
        args = ["--root", str(self.rootfs), "--manage-cgroups=ignore"]
        inherit: list[tuple[str, str]] = []
        for dest in archive.bind_mounts():
            source = self.volume(dest)
            if source is None:
                raise AgentError(
                    f"the placeholder container has nothing mounted at {dest}, where the "
                    "checkpointed container had a volume",
                    "give the placeholder pod the server pod's volumes (SnapKubeSpawner "
                    "creates it from the same pod spec); files the server had open there "
                    "cannot be restored without them",
                    409,
                )
            args += ["--external", f"mnt[{dest}]:{source}"]
        if archive.masks_files():
            args += ["--external", f"mnt[{MASK_KEY}]:/dev/null"]
        for ns in self.namespaces:
            if ns == "net" and archive.joined("network"):
                inherit.append((str(proc / "ns" / "net"), NET_KEY))
            else:
                args += ["--join-ns", f"{ns}:{proc / 'ns' / ns}"]
        for fd, key in archive.stdio_pipes().items():
            mine = proc / "fd" / str(fd)
            try:
                if os.readlink(mine).startswith("pipe:"):
                    inherit.append((str(mine), key))
            except OSError:
                continue  # no such fd: CRIU restores the pipe from the image
        return args, inherit

    def volume(self, dest: str) -> Path | None:
        """The node's path of what the placeholder has mounted at ``dest`` (None: nothing)."""
        if self.runtime is not None:
            return self.runtime.mounts.get(dest)
        path = self.rootfs / dest.lstrip("/")
        return path if path.exists() else None

    def adopt(self, pids: list[int]) -> list[int]:
        """Move any of ``pids`` not in the container's cgroup into it; return those moved."""
        moved = []
        for pid in pids:
            if self.in_cgroup(pid) or not (Path(self.proc_root) / str(pid)).exists():
                continue
            try:
                (self.cgroup / "cgroup.procs").write_text(str(pid))
            except ProcessLookupError:
                continue  # exited meanwhile
            moved.append(pid)
        return moved

    def in_cgroup(self, pid: int) -> bool:
        """Whether ``pid`` is listed in the container cgroup's ``cgroup.procs``."""
        try:
            listed = (self.cgroup / "cgroup.procs").read_text().split()
        except OSError:
            return False
        return str(pid) in listed
