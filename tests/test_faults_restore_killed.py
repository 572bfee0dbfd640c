"""Fault: the process running a restore (the Hub's spawner) is killed while CRIU restores.

CRIU runs in its own session and finishes on its own, so the server's tree comes back with
nobody to hand it out; the checkpoint is still ``verified``. The next restore must not run
a second copy next to it (same PIDs, same port): it adopts the running tree — checked like
any restore — and the server is back with its memory. Real CRIU, a real process tree, and a
real process killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from jupyterhub_gpusnap.checkpoint.local import LocalBackend
from jupyterhub_gpusnap.checkpoint.manifest import Manifest
from jupyterhub_gpusnap.model import Server
from jupyterhub_gpusnap.procs import is_alive

pytestmark = [pytest.mark.faults, pytest.mark.criu]

RESTORER = """
import asyncio, sys
from jupyterhub_gpusnap.checkpoint.local import LocalBackend

async def main():
    b = LocalBackend(checkpoint_dir=sys.argv[1], min_free_bytes=0, restore_extra_args=["--action-script", sys.argv[3]])
    await b.restore(await b.get(sys.argv[2]))

asyncio.run(main())
"""


async def test_a_restore_whose_caller_died_is_adopted_not_run_twice(tmp_path, process_tree):
    backend = LocalBackend(checkpoint_dir=str(tmp_path / "ckpt"), min_free_bytes=0)
    tree = process_tree(pidns=True)
    await tree.wait_ready()
    before = await tree.ask("inc")
    info = await backend.checkpoint(Server(user="alice", name="", state={"pid": tree.pid}))
    folder = backend.folder(info.id)

    # CRIU pauses at post-restore (marker file), so the caller can be killed mid-restore
    marker = tmp_path / "criu-is-restoring"
    hook = tmp_path / "hook.sh"
    hook.write_text(
        f'#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" = post-restore ] || exit 0\ntouch {marker}\nsleep 2\n'
    )
    hook.chmod(0o700)
    caller = subprocess.Popen(
        [sys.executable, "-c", RESTORER, str(backend.root), info.id, str(hook)],
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert caller.poll() is None and time.monotonic() < deadline, "the restore did not start"
        await asyncio.sleep(0.05)
    os.kill(caller.pid, signal.SIGKILL)  # the Hub dies; CRIU goes on by itself
    caller.wait()
    while not (folder / "restore.pid").exists():
        assert time.monotonic() < deadline, "CRIU did not finish after its caller died"
        await asyncio.sleep(0.05)
    orphan = int((folder / "restore.pid").read_text())
    while not is_alive(orphan) or not tree_listening(tree):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert Manifest.load(folder).status == "verified"  # nobody recorded the restore

    restored = await backend.restore(info)
    pid, port = restored.pid, restored.port
    tree.pid = pid  # teardown kills it
    assert pid == orphan and port == tree.port  # adopted, not restored a second time
    m = Manifest.load(folder)
    assert m.status == "restored" and m.extra["adopted"]
    after = await tree.ask("inc")
    assert after["secret"] == before["secret"] and after["count"] == before["count"] + 1


def tree_listening(tree) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", tree.port), timeout=1).close()
        return True
    except OSError:
        return False
