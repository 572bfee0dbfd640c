"""CPU use of a locally spawned server's whole process tree, as percent of one core.

The root is the spawner's ``pid`` (LocalProcessSpawner and its kin keep it in
their state, which the service reads with the ``admin:server_state`` scope).
Kernels, terminals and whatever they start are descendants of it, so a
computation in a grand-child under a sleeping shell still counts.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import psutil

from ..model import Sample, Server
from .base import SignalSource


@dataclass
class TreeReading:
    """CPU seconds of a process tree at one moment."""

    root_pid: int
    root_created: float  # create_time of the root, to notice a reused pid
    cpu_seconds: float
    clock: float  # time.monotonic() when read


def tree_cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds used so far by ``pid`` and all its descendants, and the root's create time.

    Each live process contributes its own user+system time plus the time of its
    children that already exited and were waited for (``children_user``/
    ``children_system``). When a child exits its time moves into its parent's
    children fields, so the total stays continuous across exits inside the tree.

    Raises :class:`ProcessLookupError` when ``pid`` does not exist.
    """
    try:
        root = psutil.Process(pid)
        created = root.create_time()
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        raise ProcessLookupError(f"process {pid} is gone") from None
    total = 0.0
    for index, proc in enumerate(processes):
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            if index == 0:
                raise ProcessLookupError(f"process {pid} is gone") from None
            continue  # exited between listing and reading: its time is in its parent's children
        total += t.user + t.system + t.children_user + t.children_system
    return total, created


class LocalProcessSignal(SignalSource):
    """CPU percent of one core used by a local server's process tree since the previous reading.

    The first reading of a server only sets the baseline and says nothing
    (``cpu_percent`` is ``None``).
    """

    name = "cpu"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._previous: dict[str, TreeReading] = {}

    def forget(self, key: str) -> None:
        """Drop the baseline of server ``key`` (``user/server_name``), e.g. once it stopped."""
        self._previous.pop(key, None)

    async def read(self, server: Server, now: float) -> Sample:
        pid = server.pid
        if pid is None:
            raise LookupError(
                f"{server.key} has no pid in its spawner state; the service's role needs "
                "the admin:server_state scope, and the spawner must be a local process spawner"
            )
        try:
            cpu_seconds, created = await asyncio.to_thread(tree_cpu_seconds, pid)
        except ProcessLookupError:
            self.forget(server.key)
            raise
        reading = TreeReading(pid, created, cpu_seconds, time.monotonic())
        previous = self._previous.get(server.key)
        self._previous[server.key] = reading
        if (
            previous is None
            or previous.root_pid != pid
            or previous.root_created != created
            or reading.clock <= previous.clock
        ):
            return Sample(time=now)  # new baseline: nothing to say yet
        # A descendant that escaped the tree before its parent waited for it takes its
        # time along; the total can then dip, which is "no use", not negative use.
        used = max(0.0, reading.cpu_seconds - previous.cpu_seconds)
        percent = 100.0 * used / (reading.clock - previous.clock)
        self.log.debug("cpu %s: %.1f%% of one core (pid %d)", server.key, percent, pid)
        return Sample(time=now, cpu_percent=percent)
