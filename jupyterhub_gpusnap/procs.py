"""A server's process tree: the one helper every part that looks at processes shares."""

from __future__ import annotations

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
