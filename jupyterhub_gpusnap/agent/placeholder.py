"""Restoring into a placeholder pod: find its container's process and put the restored tree there.

A GPU pod is restored into a *placeholder*: a pod with the checkpoint's image and GPU
request whose container only waits (``sleep infinity``). The agent finds that
container's first process on the node (host PIDs → pods through ``/proc/<pid>/cgroup``,
see :mod:`.pods`) and runs ``criu restore`` so that the restored tree

- sees the container's root filesystem: ``--root /proc/<pid>/root``;
- joins the pod's network, IPC and UTS namespaces: ``--join-ns net:/proc/<pid>/ns/net``
  (``ipc``, ``uts``), so the server answers on the pod IP the Hub and proxy know;
- lives in the container's cgroup, so the pod's memory/CPU limits apply, its memory is
  charged to the pod, and deleting the pod stops it. ``criu restore`` itself is started
  inside that cgroup (like runc does for container restores; ``criu.restore(cgroup=…)``
  writes the child into ``cgroup.procs`` before it execs criu), so every restored task
  is born there; ``--manage-cgroups=ignore`` keeps CRIU from recreating the checkpointed
  container's old cgroup paths. Any task found outside afterwards is moved in.

CRIU cannot join a PID namespace: the restored tree keeps host PIDs outside the
container's PID namespace (``kubectl exec … ps`` does not list it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .errors import AgentError

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

    @classmethod
    def of(cls, pid: int, proc_root: str, cgroup_root: str, join: list[str]) -> Placeholder:
        """Read the process's cgroup and namespaces; AgentError if it is gone or unreadable."""
        proc = Path(proc_root) / str(pid)
        try:
            path = cgroup_v2_path((proc / "cgroup").read_text())
            namespaces = {ns: os.readlink(proc / "ns" / ns) for ns in join}
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
        return cls(pid, proc_root, resolve_cgroup(cgroup_root, path), namespaces)

    def criu_args(self) -> list[str]:
        """``criu restore`` arguments: the container's root, namespaces and no cgroup moves."""
        proc = Path(self.proc_root) / str(self.pid)
        args = ["--root", str(proc / "root"), "--manage-cgroups=ignore"]
        for ns in self.namespaces:
            args += ["--join-ns", f"{ns}:{proc / 'ns' / ns}"]
        return args

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
