"""A server's process tree: the one helper every part that looks at processes shares."""

from __future__ import annotations

import os
import time

import psutil


def tree_pids(root_pid: int | None) -> list[int]:
    """``root_pid`` and all its descendants, root first; [] when it is gone.

    A notebook server's work happens in its kernels (children), so signals, parking and
    checkpoints all cover the whole tree.
    """
    if not root_pid:
        return []
    try:
        root = psutil.Process(root_pid)
        return [root.pid] + [c.pid for c in root.children(recursive=True)]
    except psutil.Error:
        return []


def boot_clock() -> dict:
    """Now, on the clock process start times are kept in: seconds since this boot
    (``CLOCK_BOOTTIME``) and the boot's id. Wall-clock time cannot be compared with a
    process's start (psutil derives that from ``btime``, whole seconds)."""
    return {"boot_id": _boot_id(), "since_boot": time.clock_gettime(time.CLOCK_BOOTTIME)}


def started_since(pid: int, stamp: dict) -> bool | None:
    """True if ``pid`` started at or after ``stamp`` (from :func:`boot_clock`), False if
    before, None if that cannot be told (gone, or another boot)."""
    if not stamp or stamp.get("boot_id") != _boot_id():
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[19])  # starttime, field 22: clock ticks after boot
    except (OSError, IndexError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    return ticks >= int(float(stamp["since_boot"]) * hz)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
