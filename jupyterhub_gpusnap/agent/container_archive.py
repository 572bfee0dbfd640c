"""What a container runtime's checkpoint archive says about the container it froze.

The kubelet's checkpoint API makes the runtime (CRI-O, or containerd through runc) write
one tar per container, unpacked here by :func:`~.ship.extract_archive`:

- ``checkpoint/``: CRIU's images, from ``runc checkpoint``. runc marks what lies outside
  the container as *external* there: its bind mounts (key: the mount's destination),
  masked files (key ``/dev/null``), the network namespace when the container joined the
  pod's (key ``extRootNetNS``), and it lists the container's stdio in
  ``descriptors.json`` (``pipe:[ino]`` for the pipes CRI-O's conmon gave it);
- ``spec.dump``: the container's OCI spec (its mounts, namespaces, masked paths);
- ``bind.mounts``: CRI-O's list of the bind mounts with their file types;
- ``rootfs-diff.tar`` and ``deleted.files``: the container's changes to its image's
  files (its writable layer), which a restore must put back before CRIU reopens them;
- ``config.dump``, ``dump.log``, ``stats-dump``: metadata and logs.

A restore must give CRIU each external thing back (:meth:`Placeholder.restore_args
<.placeholder.Placeholder.restore_args>`), and the writable layer back into the
placeholder's root filesystem (:func:`apply_rootfs_diff`).
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from ..kube.errors import AgentError

#: The external key runc gives the pod network namespace a container joined.
NET_KEY = "extRootNetNS"
#: The external key runc gives masked files (bind mounts of /dev/null).
MASK_KEY = "/dev/null"


@dataclass
class ContainerArchive:
    """An unpacked checkpoint archive: ``folder`` holds ``checkpoint/`` (the images)."""

    folder: Path
    spec: dict = field(default_factory=dict)
    descriptors: list[str] = field(default_factory=list)

    @property
    def images(self) -> Path:
        return self.folder / "checkpoint"

    @classmethod
    def read(cls, images: Path) -> ContainerArchive:
        """Read the archive around CRIU's images folder ``images`` (``…/checkpoint``)."""
        folder = Path(images).parent
        spec = _json(folder / "spec.dump", {})
        descriptors = _json(Path(images) / "descriptors.json", [])
        if not isinstance(spec, dict) or not isinstance(descriptors, list):
            raise AgentError(
                "the checkpoint archive's spec.dump or checkpoint/descriptors.json is not what "
                "a container runtime writes",
                "the image is not a kubelet checkpoint archive",
                422,
            )
        return cls(folder, spec, [str(d) for d in descriptors])

    def bind_mounts(self) -> list[str]:
        """Destinations of the container's bind mounts (CRIU externals, keyed by destination)."""
        out = []
        for m in self.spec.get("mounts") or []:
            if (
                m.get("type") == "bind"
                or "bind" in (m.get("options") or [])
                or "rbind" in (m.get("options") or [])
            ):
                out.append(m["destination"])
        return out

    def masks_files(self) -> bool:
        """Whether runc masked paths with /dev/null (CRIU external ``/dev/null``)."""
        return bool((self.spec.get("linux") or {}).get("maskedPaths"))

    def joined(self, namespace: str) -> bool:
        """Whether the container joined an existing ``namespace`` (``network``, ``ipc``,
        ``uts``…) by path, as a pod's containers join the sandbox's: runc then dumped it as
        external (the network namespace) or CRIU saved it to restore a copy."""
        for ns in (self.spec.get("linux") or {}).get("namespaces") or []:
            if ns.get("type") == namespace:
                return bool(ns.get("path"))
        return False

    def stdio_pipes(self) -> dict[int, str]:
        """The container's stdio that were pipes: fd → CRIU's key (``pipe:[ino]``)."""
        return {i: key for i, key in enumerate(self.descriptors[:3]) if key.startswith("pipe:")}

    def deleted_files(self) -> list[str]:
        value = _json(self.folder / "deleted.files", [])
        return [str(p) for p in value] if isinstance(value, list) else []


def _json(path: Path, default):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return default
    except (OSError, ValueError) as e:
        raise AgentError(
            f"cannot read {path.name} of the checkpoint archive: {e}",
            "the image is not a kubelet checkpoint archive",
            422,
        ) from e


def _inside(rootfs: Path, name: str) -> Path | None:
    """``name`` (absolute inside the container) under ``rootfs``, or None if it resolves
    outside it (a symlink in the container's files pointing out)."""
    path = rootfs / name.lstrip("/")
    real = os.path.realpath(path.parent)
    if not _within(real, os.path.realpath(rootfs)):
        return None
    return Path(real) / path.name


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root + os.sep)


def _rootfs_member(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    """tarfile's ``tar`` filter (nothing outside ``dest``, no setuid bits, owners kept:
    the container's files belong to its users), and no hard link to a file outside
    ``dest`` nor device nodes: the node's files must not appear inside the container."""
    member = tarfile.tar_filter(member, dest)
    if member.islnk():
        target = os.path.realpath(os.path.join(dest, member.linkname))
        if not _within(target, os.path.realpath(dest)):
            raise tarfile.LinkOutsideDestinationError(member, target)
    if member.isdev():
        raise tarfile.SpecialFileError(member)
    return member


def apply_rootfs_diff(archive: ContainerArchive, rootfs: Path) -> int:
    """Put the container's writable layer back into ``rootfs`` (the placeholder's root
    filesystem, as the node sees it): unpack ``rootfs-diff.tar`` and delete what
    ``deleted.files`` lists, as CRI-O does before it restores. Returns the entries written.

    The tar comes from the user's container: members that would land outside ``rootfs``
    (absolute paths, ``..``, symlinks in the way), hard links to files outside it and
    device nodes are refused, setuid bits dropped (:func:`_rootfs_member`); deletions
    outside ``rootfs`` are refused the same way. Every member is checked before anything
    is written; one that escapes only through a symlink the archive itself creates is
    caught while extracting (the restore stops there, the image is kept).
    """
    diff = archive.folder / "rootfs-diff.tar"
    written = 0
    if diff.exists():
        try:
            with tarfile.open(diff, "r:") as tar:
                members = tar.getmembers()
                for member in members:
                    _rootfs_member(member, str(rootfs))
                tar.extractall(rootfs, members=members, filter=_rootfs_member)
                written = len(members)
        except (tarfile.TarError, OSError) as e:
            raise AgentError(
                f"cannot apply the checkpoint's rootfs-diff.tar to the placeholder: {e}",
                "the archive's file changes would land outside the container's root "
                "filesystem, or the node's disk is full: the image is kept",
                422 if isinstance(e, tarfile.TarError) else 507,
            ) from e
    for name in archive.deleted_files():
        path = _inside(rootfs, name)
        if path is None:
            raise AgentError(
                f"deleted.files of the checkpoint names {name}, outside the container",
                "the image is not a kubelet checkpoint archive",
                422,
            )
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            pass
    return written
