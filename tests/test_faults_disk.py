"""Fault: the disk fills up while a server is being checkpointed.

``checkpoint_dir`` is a real, small filesystem (a 48 MiB tmpfs mounted for the test). The
server is a real process tree in its own PID namespace. It is small when the backend
estimates the image size (the preflight passes), and grows by 96 MiB at CRIU's
``pre-dump`` action, after the estimate and before its memory is read: CRIU runs out of
space half-way through the image. The suspension goes through the service's real
watcher (store, events, metrics) and the real LocalBackend with real CRIU.

Afterwards the server runs on with the same memory, the checkpoint is ``failed`` with a
reason that names the full disk, the watcher's state, events and metrics say so, nothing
half-written counts as verified, and once the service's next loop ran, the space is given
back and the next suspension succeeds.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from jupyterhub_gpusnap import metrics
from jupyterhub_gpusnap.checkpoint.base import CheckpointError, CheckpointRefused
from jupyterhub_gpusnap.checkpoint.local import LocalBackend
from jupyterhub_gpusnap.checkpoint.manifest import MANIFEST, Manifest
from jupyterhub_gpusnap.model import Server, State
from jupyterhub_gpusnap.policy import Policy, Rule
from jupyterhub_gpusnap.procs import is_alive, is_frozen
from jupyterhub_gpusnap.store import Store
from jupyterhub_gpusnap.watcher import Watcher

pytestmark = [pytest.mark.faults, pytest.mark.criu]

DISK_MIB = 48
GROW_MIB = 96

# A server holding state in memory that can grow ("alloc N" MiB) and shrink ("free").
PROGRAM = r"""
import json, os, socket, sys
port = int(sys.argv[1])  # (argv[2], a log path, is not used)
state = {"count": 0, "secret": os.urandom(8).hex()}
ballast = []
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port))
s.listen(8)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    cmd = c.recv(100).decode().split()
    if cmd[0] == "inc":
        state["count"] += 1
    elif cmd[0] == "alloc":
        ballast.append(bytes([0x5A]) * (int(cmd[1]) << 20))
    elif cmd[0] == "free":
        ballast.clear()
    c.sendall(json.dumps(dict(state, pid=os.getpid(), ballast=sum(map(len, ballast)))).encode())
    c.close()
"""


@pytest.fixture
def small_disk(tmp_path):
    """A real 48 MiB filesystem (tmpfs) for checkpoint_dir; unmounted at teardown."""
    path = tmp_path / "small-disk"
    path.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_MIB}m,mode=0700", "tmpfs", str(path)],
        check=True,
    )
    yield path
    # a restored tree's criu may take a moment to exit after the tree is killed
    for _ in range(100):
        if subprocess.run(["umount", str(path)], capture_output=True).returncode == 0:
            return
        time.sleep(0.1)
    subprocess.run(["umount", "--lazy", str(path)], check=True)


@pytest.fixture
async def server(process_tree):
    """The program above as the init of its own PID namespace (as the spawner runs servers)."""
    s = process_tree(pidns=True, program=PROGRAM)
    await s.wait_ready()
    return s


def grow_at_pre_dump(tmp_path: Path, port: int) -> str:
    """A CRIU action script: at pre-dump (the tree still runs), the server grows by GROW_MIB."""
    hook = tmp_path / "grow.sh"
    ask = (
        f"import socket; c = socket.create_connection(('127.0.0.1', {port}), timeout=20); "
        f"c.sendall(b'alloc {GROW_MIB}'); c.recv(4096)"
    )
    hook.write_text(
        '#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" = pre-dump ] || exit 0\n'
        f'exec {sys.executable} -c "{ask}"\n'
    )
    hook.chmod(0o700)
    return str(hook)


def counter(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


async def test_disk_full_during_a_dump(small_disk, server, tmp_path):
    before = await server.ask("inc")
    backend = LocalBackend(
        checkpoint_dir=str(small_disk / "checkpoints"),
        min_free_bytes=0,
        dump_extra_args=["--action-script", grow_at_pre_dump(tmp_path, server.port)],
    )
    store = Store(f"sqlite:///{tmp_path / 'gpusnap.sqlite'}")
    rule = Rule(name="default", idle_window=3600, warn_before=0, min_running=0)
    watcher = Watcher(
        hub=None,  # never reached: a failed checkpoint stops nothing
        store=store,
        policy=Policy(rules=[], default=rule),
        sources=[],
        backend=backend,
    )
    alice = Server(user="alice", name="", state={"pid": server.pid})
    failed_before = counter("gpusnap_failures_total", kind="suspend")
    actions_before = counter("gpusnap_actions_total", action="suspend", result="failed")
    try:
        # the preflight passes: the estimate fits the disk
        await backend.check(alice)
        await watcher.start_suspend(alice, reason="idle")

        # the server goes on, with the same memory, no longer frozen
        assert is_alive(server.pid) and not is_frozen(server.pid)
        after = await server.ask("inc")
        assert after["secret"] == before["secret"] and after["count"] == before["count"] + 1
        assert after["ballast"] == GROW_MIB << 20  # it did grow during the dump

        # the checkpoint is failed, and says the disk is full
        (found,) = await backend.list()
        assert found.status == "failed", found
        assert "No space left on device" in found.error or "full" in found.error, found.error
        assert str(backend.root) in found.error, found.error  # names where to make room
        assert await backend.latest("alice", "") is None
        # nothing left "being written": the spawner's stop and start do not wait for it
        assert await backend.writing("alice", "") is None
        for manifest in backend.root.rglob(MANIFEST):
            assert Manifest.load(manifest.parent).status != "verified"

        # the watcher recorded it: state, event, metrics
        status = store.get("alice/")
        assert status.state == State.failed and "No space left on device" in status.failure, status
        (event,) = [e for e in store.events("alice/") if e["kind"] == "suspend_failed"]
        assert "No space left on device" in event["detail"]["error"]
        assert counter("gpusnap_failures_total", kind="suspend") == failed_before + 1
        assert (
            counter("gpusnap_actions_total", action="suspend", result="failed")
            == actions_before + 1
        )

        # the service's next loop (retention) leaves nothing half-done and gives the space back
        await backend.apply_retention()
        assert not list(backend.root.rglob("*.img")), (
            "a failed, half-written image still fills the disk"
        )
        assert shutil.disk_usage(small_disk).free > (DISK_MIB - 4) << 20

        # with room again (the server gives its memory back), the next suspension succeeds
        await server.ask("free")
        backend.dump_extra_args = []
        info = await backend.checkpoint(alice)
        assert info.status == "verified"
        assert not is_alive(server.pid)
        pid = (await backend.restore(info)).pid
        server.pid = pid
        back = await server.ask("get")
        assert back["secret"] == before["secret"] and back["count"] == after["count"]
    finally:
        store.close()


def fill_at_pre_dump(tmp_path: Path) -> str:
    """A CRIU action script: at pre-dump, a file in the image folder takes the disk's last
    byte (as a half-written pages image does), so CRIU's own log cannot say why it failed."""
    hook = tmp_path / "fill.sh"
    hook.write_text(
        '#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" = pre-dump ] || exit 0\n'
        'dd if=/dev/zero of="$CRTOOLS_IMAGE_DIR/pages-filler.img" bs=64k 2>/dev/null\n'
        "exit 0\n"
    )
    hook.chmod(0o700)
    return str(hook)


async def test_disk_full_when_the_log_cannot_say_so(small_disk, server, tmp_path):
    """The disk fills to the last byte: CRIU's log (on that disk) is cut short and even the
    failure record does not fit. The backend asks the disk, gives the partial image's space
    back and records the failure naming the full disk; nothing stays "being written"."""
    before = await server.ask("inc")
    backend = LocalBackend(
        checkpoint_dir=str(small_disk / "checkpoints"),
        min_free_bytes=0,
        dump_extra_args=["--action-script", fill_at_pre_dump(tmp_path)],
    )
    alice = Server(user="alice", name="", state={"pid": server.pid})
    with pytest.raises(CheckpointError):
        await backend.checkpoint(alice)

    # the server goes on with the same memory
    assert is_alive(server.pid) and not is_frozen(server.pid)
    after = await server.ask("inc")
    assert after["secret"] == before["secret"] and after["count"] == before["count"] + 1

    (found,) = await backend.list()
    log = (backend.folder(found.id) / "dump.log").read_text(errors="replace")
    assert "No space left on device" not in log  # the case under test: the log cannot say
    assert found.status == "failed", found
    assert "No space left on device" in found.error and str(backend.root) in found.error
    assert await backend.writing("alice", "") is None
    # the space is back at once, before any retention pass
    assert not list(backend.root.rglob("*.img"))
    assert shutil.disk_usage(small_disk).free > (DISK_MIB - 4) << 20

    backend.dump_extra_args = []
    info = await backend.checkpoint(alice)
    assert info.status == "verified"
    pid = (await backend.restore(info)).pid
    server.pid = pid
    back = await server.ask("get")
    assert back["secret"] == before["secret"] and back["count"] == after["count"]


@pytest.fixture
def sized_disk(tmp_path):
    """``mount(mib)``: a real tmpfs of that size for checkpoint_dir; unmounted at teardown."""
    mounted: list[Path] = []

    def mount(mib: int) -> Path:
        path = tmp_path / f"disk-{len(mounted)}"
        path.mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0700", "tmpfs", str(path)], check=True
        )
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        for _ in range(100):
            if subprocess.run(["umount", str(path)], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        else:
            subprocess.run(["umount", "--lazy", str(path)], check=True)


def tree_rss(pid: int) -> int:
    """What the backend estimates a server's image at: the RSS of its processes."""
    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


async def test_two_suspensions_racing_for_the_disk(sized_disk, process_tree):
    """Two servers that each fit the disk alone but not together are suspended at the same
    moment: the first to pass the preflight reserves its estimate, the second is refused
    before anything of it is frozen (naming the suspension that holds the space), and both
    servers are fine: one suspended and restorable, the other running on untouched."""
    servers = [process_tree(pidns=True, program=PROGRAM) for _ in range(2)]
    for s in servers:
        await s.wait_ready()
        await s.ask("alloc 64")
    before = [await s.ask("inc") for s in servers]
    estimate = max(tree_rss(s.pid) for s in servers)
    # one image fits with room to spare, two do not (an image is about its RSS)
    disk = sized_disk(int(estimate * 1.5) >> 20)
    backend = LocalBackend(checkpoint_dir=str(disk / "checkpoints"), min_free_bytes=0)
    users = ["alice", "bob"]
    targets = [
        Server(user=u, name="", state={"pid": s.pid}) for u, s in zip(users, servers, strict=True)
    ]

    results = await asyncio.gather(
        *(backend.checkpoint(t) for t in targets), return_exceptions=True
    )

    ok = [i for i, r in enumerate(results) if not isinstance(r, BaseException)]
    refused = [i for i, r in enumerate(results) if isinstance(r, CheckpointRefused)]
    assert len(ok) == 1 and len(refused) == 1, results
    (won,), (lost,) = ok, refused
    why = str(results[lost])
    assert f"reserved by suspensions under way ({users[won]}/)" in why, why
    assert "Nothing was frozen" in why and results[lost].retry
    # the refused server: nothing written for it, never frozen, same memory
    assert [c.key for c in await backend.list()] == [f"{users[won]}/"]
    assert is_alive(servers[lost].pid) and not is_frozen(servers[lost].pid)
    after = await servers[lost].ask("inc")
    assert after["secret"] == before[lost]["secret"] and after["count"] == before[lost]["count"] + 1
    # the suspended one restores with its memory
    info = results[won]
    assert info.status == "verified" and not is_alive(servers[won].pid)
    servers[won].pid = (await backend.restore(info)).pid
    back = await servers[won].ask("get")
    assert back["secret"] == before[won]["secret"] and back["count"] == before[won]["count"]
    # the reservation ended with the dump: once the disk has room, the other one suspends
    await backend.delete(info.id)
    other = await backend.checkpoint(targets[lost])
    assert other.status == "verified"
    servers[lost].pid = (await backend.restore(other)).pid
    assert (await servers[lost].ask("get"))["count"] == after["count"]
