"""checkpoint_dir is root's alone: another Unix user cannot list names in it nor read it.

A real user (useradd) tries from its own process; the checkpoint_dir lies where any user
can reach it (under /tmp) and was created 0755 beforehand, as an install by hand or an
older version leaves it. The server folder a spawner makes for a server's log
(``os.makedirs(..., mode=0o700)``, which makes the parents 0755) is there too.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from jupyterhub_gpusnap.checkpoint.chunks import STORE
from jupyterhub_gpusnap.checkpoint.local import LocalBackend
from jupyterhub_gpusnap.checkpoint.manifest import MANIFEST
from jupyterhub_gpusnap.model import Server
from tests.helpers.process_tree import TREE_PROGRAM

pytestmark = pytest.mark.criu

# Run as the other user: every path is tried for listing (folders) or reading (files).
PROBE = r"""
import json, os, sys
out = {}
for path in sys.argv[1:]:
    try:
        if os.path.isdir(path):
            out[path] = sorted(os.listdir(path))
        else:
            with open(path, "rb") as f:
                out[path] = len(f.read())
    except PermissionError:
        out[path] = "denied"
    except OSError as e:
        out[path] = f"error: {e}"
print(json.dumps(out))
"""


@pytest.fixture
def open_parent():
    """A folder under /tmp that every user may enter (0755), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="gpusnap-perm-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_another_user_can_neither_list_nor_read_checkpoint_dir(
    open_parent, process_tree, system_users, caplog
):
    ckpt = open_parent / "checkpoints"
    ckpt.mkdir(mode=0o755)
    os.chmod(ckpt, 0o755)
    backend = LocalBackend(
        checkpoint_dir=str(ckpt), min_free_bytes=0, storage="chunks", average_chunk_bytes=64 << 10
    )
    await backend.setup()
    assert stat.S_IMODE(ckpt.stat().st_mode) == 0o700
    assert f"{ckpt} was mode 0755" in caplog.text  # tightened, and said so
    # a server's log folder, made as the spawner makes it (its parent "alice" is then 0755)
    os.makedirs(ckpt / "alice" / "_default", mode=0o700, exist_ok=True)
    (ckpt / "alice" / "_default" / "server.log").write_text("hello\n")
    tree = process_tree(pidns=True, program=TREE_PROGRAM)
    await tree.wait_ready()
    info = await backend.checkpoint(Server(user="alice", name="", state={"pid": tree.pid}))
    folder = backend.folder(info.id)

    folders = [p for p in [ckpt, *ckpt.rglob("*")] if p.is_dir()]
    assert {ckpt / "alice", ckpt / STORE, ckpt / STORE / "plain"} <= set(folders)
    for path in folders:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    chunk = next(p for p in (ckpt / STORE / "plain").rglob("*") if p.is_file())

    mallory = system_users()
    targets = [ckpt, ckpt / "alice", ckpt / STORE, ckpt / STORE / "plain", chunk.parent,
               folder / MANIFEST, chunk, ckpt / "alice" / "_default" / "server.log"]  # fmt: skip
    run = subprocess.run(
        ["/usr/bin/python3", "-c", PROBE, *map(str, targets)],
        user=mallory.pw_uid, group=mallory.pw_gid, capture_output=True, text=True, check=True,
        cwd="/",
    )  # fmt: skip
    seen = json.loads(run.stdout)
    assert seen == {str(t): "denied" for t in targets}, seen
    # the open parent itself is listable by that user: the probe could have seen in
    assert (
        subprocess.run(
            ["/usr/bin/python3", "-c", PROBE, str(open_parent)],
            user=mallory.pw_uid, group=mallory.pw_gid, capture_output=True, text=True, check=True,
        ).stdout.strip()
        == json.dumps({str(open_parent): ["checkpoints"]})
    )  # fmt: skip
