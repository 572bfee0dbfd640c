"""A container runtime's checkpoint archive as the agent reads it, and the file changes
it carries put back into a placeholder's root filesystem without reaching the node's files."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from jupyterhub_gpusnap.agent.container_archive import ContainerArchive, apply_rootfs_diff
from jupyterhub_gpusnap.kube.errors import AgentError


def archive_with(tmp_path: Path, members: list[tarfile.TarInfo], deleted: list[str] | None = None,
                 spec: dict | None = None) -> ContainerArchive:  # fmt: skip
    folder = tmp_path / "archive"
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "checkpoint" / "descriptors.json").write_text(
        json.dumps(["/dev/null", "pipe:[41]", "pipe:[41]"])
    )
    (folder / "spec.dump").write_text(json.dumps(spec or {}))
    with tarfile.open(folder / "rootfs-diff.tar", "w") as tar:
        for m in members:
            data = b"x" * m.size if m.isfile() else None
            tar.addfile(m, io.BytesIO(data) if data is not None else None)
    if deleted is not None:
        (folder / "deleted.files").write_text(json.dumps(deleted))
    return ContainerArchive.read(folder / "checkpoint")


def member(name: str, kind: bytes = tarfile.REGTYPE, size: int = 3, link: str = "", mode: int = 0o644,
           uid: int = 1000) -> tarfile.TarInfo:  # fmt: skip
    m = tarfile.TarInfo(name)
    m.type, m.size, m.linkname, m.mode, m.uid, m.gid = (
        kind,
        size if kind == tarfile.REGTYPE else 0,
        link,
        mode,
        uid,
        100,
    )
    return m


@pytest.fixture
def rootfs(tmp_path):
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "debian_version").write_text("12\n")
    (root / "usr").mkdir()
    return root


def test_file_changes_land_in_the_root_filesystem_with_their_owners(tmp_path, rootfs):
    archive = archive_with(
        tmp_path,
        [
            member("var/", tarfile.DIRTYPE, mode=0o755),
            member("var/made"),
            member("usr/local-tool", mode=0o4755),
            member("usr/py", tarfile.SYMTYPE, link="/usr/bin/python3"),
        ],  # fmt: skip
        deleted=["/etc/debian_version"],
    )
    assert apply_rootfs_diff(archive, rootfs) == 4
    made = rootfs / "var" / "made"
    assert made.read_bytes() == b"xxx" and made.stat().st_uid == 1000
    assert not (rootfs / "usr" / "local-tool").stat().st_mode & 0o4000  # no setuid
    assert os.readlink(rootfs / "usr" / "py") == "/usr/bin/python3"  # inside the container
    assert not (rootfs / "etc" / "debian_version").exists()
    assert archive.stdio_pipes() == {1: "pipe:[41]", 2: "pipe:[41]"}


@pytest.mark.parametrize(
    "members",
    [
        [member("../outside")],
        [member("/../../outside")],
        # a hard link to a node file would put it inside the container
        [member("etc/shadow-copy", tarfile.LNKTYPE, link="../../outside-target")],
        [member("dev/sda", tarfile.BLKTYPE)],
        # through a symlink the archive creates first
        [member("escape", tarfile.SYMTYPE, link="/"), member("escape/tmp/outside")],
    ],
    ids=["dotdot", "absolute", "hardlink-out", "device", "symlink-then-write"],
)
def test_file_changes_that_would_reach_the_node_are_refused(tmp_path, rootfs, members):
    (tmp_path / "outside-target").write_text("node secret")
    archive = archive_with(tmp_path, members)
    with pytest.raises(AgentError) as refused:
        apply_rootfs_diff(archive, rootfs)
    assert refused.value.code == 422 and "rootfs-diff.tar" in refused.value.message
    assert not (tmp_path / "outside").exists() and not Path("/tmp/outside").exists()
    assert not (rootfs / "etc" / "shadow-copy").exists()


def test_a_deletion_outside_the_root_filesystem_is_refused(tmp_path, rootfs):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (rootfs / "link").symlink_to(tmp_path)
    for name in ("/link/victim", "/../victim"):
        archive = archive_with(tmp_path / name.replace("/", "_"), [], deleted=[name])
        with pytest.raises(AgentError, match="outside the container"):
            apply_rootfs_diff(archive, rootfs)
    assert victim.read_text() == "keep"


def test_what_the_runtime_marked_external_is_read_from_the_spec(tmp_path):
    spec = {
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {
                "destination": "/etc/hosts",
                "type": "bind",
                "source": "/x/hosts",
                "options": ["rbind"],
            },
            {"destination": "/home/jovyan", "source": "/x/home", "options": ["rbind", "rw"]},
        ],
        "linux": {
            "maskedPaths": ["/proc/kcore"],
            "namespaces": [{"type": "pid"}, {"type": "network", "path": "/proc/7/ns/net"}],
        },
    }
    archive = archive_with(tmp_path, [], spec=spec)
    assert archive.bind_mounts() == ["/etc/hosts", "/home/jovyan"]
    assert archive.masks_files() and archive.joined("network") and not archive.joined("pid")
    broken = tmp_path / "broken"
    (broken / "checkpoint").mkdir(parents=True)
    (broken / "spec.dump").write_text("{not json")
    with pytest.raises(AgentError, match="spec.dump") as e:
        ContainerArchive.read(broken / "checkpoint")
    assert e.value.code == 422
