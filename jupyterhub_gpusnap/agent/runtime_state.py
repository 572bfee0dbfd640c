"""Where a running container's files are on the node, from its OCI runtime's state.

A placeholder container lives in its own mount namespace; the kernel refuses to bind
mount from another mount namespace, so CRIU cannot take the placeholder's root or
volumes through ``/proc/<pid>/root``. runc keeps each container's state in
``<runtime root>/<container id>/state.json`` (CRI-O: ``/run/runc``; containerd:
``/run/containerd/runc/k8s.io``) with the node's paths of the container's root
filesystem (``config.rootfs``) and of every bind mount's source (``config.mounts``):
what a restore into that container needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RuntimeState:
    """A running container as its runtime recorded it, paths as the agent sees them."""

    container_id: str
    rootfs: Path
    mounts: dict[str, Path] = field(default_factory=dict)  # bind destination -> source
    init_pid: int = 0
    state_file: Path | None = None


def find_state(container_id: str, roots: list[str], host_root: str = "") -> RuntimeState | None:
    """The runc state of ``container_id`` under the first of ``roots`` that has it, or None.

    ``host_root``: where the node's ``/`` is visible to the agent ("" when the agent runs
    in the node's mount namespace); prefixed to the state folders and to every path read.
    """
    prefix = Path(host_root) if host_root else None

    def on_node(path: str) -> Path:
        return prefix / path.lstrip("/") if prefix else Path(path)

    for root in roots:
        state_file = on_node(root) / container_id / "state.json"
        try:
            state = json.loads(state_file.read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError):
            continue
        config = state.get("config") or {}
        if not config.get("rootfs"):
            continue
        mounts = {
            m["destination"]: on_node(m["source"])
            for m in config.get("mounts") or []
            if m.get("device") == "bind" and m.get("source") and m.get("destination")
        }
        return RuntimeState(
            container_id,
            on_node(config["rootfs"]),
            mounts,
            int(state.get("init_process_pid") or 0),
            state_file,
        )
    return None
