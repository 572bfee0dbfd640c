"""Host PIDs → pods, and pod CPU use, read from the kernel's own files.

With ``hostPID`` the agent sees every process of the node. Each process's
``/proc/<pid>/cgroup`` names its cgroup; under Kubernetes that path carries the pod
UID (``…/kubepods-burstable-pod<uid with _>.slice/cri-containerd-<id>.scope`` with the
systemd driver, ``/kubepods/burstable/pod<uid>/<id>`` with cgroupfs). The pod's
cgroup directory holds a cgroup v2 ``cpu.stat`` whose ``usage_usec`` counts every
microsecond of CPU its containers used; two readings give a percentage of one core.

``proc_root`` and ``cgroup_root`` are traits so that the same code reads a tree
under a temporary folder in tests.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from traitlets import Unicode
from traitlets.config import LoggingConfigurable

_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_POD_SEGMENT = re.compile(rf"pod({_UID})(?:\.slice)?$")
_CONTAINER_SEGMENT = re.compile(
    r"^(?:cri-containerd-|crio-|docker-|containerd-)?([0-9a-f]{64})(?:\.scope)?$"
)


@dataclass
class CgroupPlace:
    """Where one process sits: its pod UID, the pod's cgroup path, and its container ID."""

    pod_uid: str
    pod_cgroup: (
        str  # path relative to the cgroup root, e.g. /kubepods.slice/.../kubepods-pod<uid>.slice
    )
    container_id: str = ""


def parse_cgroup(text: str) -> CgroupPlace | None:
    """Find the pod in the contents of ``/proc/<pid>/cgroup`` (v2 ``0::`` line first, then v1)."""
    lines = [line.split(":", 2) for line in text.splitlines() if line.count(":") >= 2]
    lines.sort(key=lambda parts: parts[0] != "0")  # the unified hierarchy first
    for parts in lines:
        path = parts[2]
        segments = path.split("/")
        for i, segment in enumerate(segments):
            m = _POD_SEGMENT.search(segment)
            if not m:
                continue
            container = ""
            if i + 1 < len(segments):
                c = _CONTAINER_SEGMENT.match(segments[i + 1])
                container = c.group(1) if c else ""
            return CgroupPlace(
                pod_uid=m.group(1).replace("_", "-"),
                pod_cgroup="/".join(segments[: i + 1]) or "/",
                container_id=container,
            )
    return None


def parse_cpu_stat(text: str) -> int:
    """``usage_usec`` from a cgroup v2 ``cpu.stat``."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "usage_usec":
            return int(value)
    raise ValueError("cpu.stat has no usage_usec line (is this a cgroup v2 hierarchy?)")


@dataclass
class PodProcesses:
    """The processes of one pod on this node."""

    uid: str
    cgroup: str
    pids: list[int] = field(default_factory=list)
    containers: dict[str, list[int]] = field(default_factory=dict)  # container ID -> pids


class PodMapper(LoggingConfigurable):
    """Maps host PIDs to pods and reads pod cgroups."""

    proc_root = Unicode(
        "/proc",
        help="Where the host's /proc is visible to the agent. With hostPID: true this is /proc.",
    ).tag(config=True)

    cgroup_root = Unicode(
        "/sys/fs/cgroup",
        help="Where the host's cgroup v2 hierarchy is mounted in the agent's container "
        "(mount the host's /sys/fs/cgroup read-only there).",
    ).tag(config=True)

    def place_of(self, pid: int) -> CgroupPlace | None:
        """The pod a host PID belongs to, or None (not in a pod, or gone)."""
        try:
            text = (Path(self.proc_root) / str(pid) / "cgroup").read_text()
        except OSError:
            return None
        return parse_cgroup(text)

    def scan(self) -> dict[str, PodProcesses]:
        """Every pod with processes on this node: pod UID → its processes."""
        pods: dict[str, PodProcesses] = {}
        try:
            entries = os.listdir(self.proc_root)
        except OSError:
            return pods
        for entry in entries:
            if not entry.isdigit():
                continue
            pid = int(entry)
            place = self.place_of(pid)
            if place is None:
                continue
            pod = pods.setdefault(place.pod_uid, PodProcesses(place.pod_uid, place.pod_cgroup))
            pod.pids.append(pid)
            if place.container_id:
                pod.containers.setdefault(place.container_id, []).append(pid)
        for pod in pods.values():
            pod.pids.sort()
            for pids in pod.containers.values():
                pids.sort()
        return pods

    def cpu_usage_usec(self, cgroup: str) -> int:
        """CPU microseconds a cgroup (a pod) has used since it was created."""
        path = Path(self.cgroup_root) / cgroup.lstrip("/") / "cpu.stat"
        return parse_cpu_stat(path.read_text())


class CpuMeter:
    """Turns cumulative ``usage_usec`` readings into percent of one core between readings."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._last: dict[str, tuple[int, float]] = {}

    def update(self, key: str, usage_usec: int, now: float | None = None) -> float | None:
        """Record a reading; return the percent since the previous one (None for the first)."""
        now = self.clock() if now is None else now
        previous = self._last.get(key)
        self._last[key] = (usage_usec, now)
        if previous is None or now <= previous[1] or usage_usec < previous[0]:
            return None
        return (usage_usec - previous[0]) / ((now - previous[1]) * 1e6) * 100.0

    def forget(self, keep: set[str]) -> None:
        """Drop readings of pods that are gone."""
        for key in list(self._last):
            if key not in keep:
                del self._last[key]


def container_id(status_id: str) -> str:
    """``containerd://<id>`` (a pod's containerStatuses[].containerID) → ``<id>``."""
    return status_id.partition("://")[2] or status_id
