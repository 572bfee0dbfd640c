"""LocalBackend against real process trees, real CRIU and real files on disk."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from jupyterhub_gpusnap.checkpoint import CheckpointError, CheckpointRefused
from jupyterhub_gpusnap.checkpoint.local import LocalBackend
from jupyterhub_gpusnap.checkpoint.local_layout import encode_name
from jupyterhub_gpusnap.checkpoint.manifest import (
    MANIFEST,
    Manifest,
    Writeback,
    check_complete,
    seal_image,
    verify_checkpoint,
    verify_image,
)
from jupyterhub_gpusnap.model import Server
from jupyterhub_gpusnap.procs import is_alive, is_frozen

pytestmark = pytest.mark.criu


@pytest.fixture
def backend(tmp_path):
    return LocalBackend(checkpoint_dir=str(tmp_path / "ckpt"), min_free_bytes=0)


def server_of(tree, user="alice", name=""):
    return Server(user=user, name=name, state={"pid": tree.pid})


def action_script(tmp_path, body: str) -> str:
    """A CRIU --action-script running ``body`` at post-dump (the tree is still frozen)."""
    path = tmp_path / "hook.sh"
    path.write_text(f'#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0\n{body}\n')
    path.chmod(0o700)
    return str(path)


async def restore_and_track(backend, tree, info):
    restored = await backend.restore(info)
    pid, ip, port = restored.pid, restored.ip, restored.port
    tree.pid = pid  # teardown kills the restored tree
    return pid, ip, port


async def test_checkpoint_verify_kill_restore_same_memory(backend, process_tree):
    tree = process_tree(pidns=True)
    await tree.wait_ready()
    await tree.ask("inc")
    before = await tree.ask("inc")
    old_pid = tree.pid

    info = await backend.checkpoint(server_of(tree, name="gpu-1"))
    assert info.status == "verified" and info.key == "alice/gpu-1"
    assert not is_alive(old_pid)  # killed only after verification
    tree.proc.wait()
    folder = backend.folder(info.id)
    assert folder.parent == backend.root / "alice" / "gpu-1"
    m = json.loads((folder / MANIFEST).read_text())
    assert m["status"] == "verified" and m["user"] == "alice" and m["server"] == "gpu-1"
    assert m["pid"] == old_pid and m["port"] == tree.port and m["ip"] == "127.0.0.1"
    assert m["image_bytes"] > 0 and m["image_bytes"] == info.image_bytes
    assert "pstree.img" in m["files"] and len(m["files"]["pstree.img"]) == 64
    assert m["criu_version"].startswith("4.")
    assert m["time_to_gpu_free_s"] is not None and m["gpu_bytes"] == 0
    for path in [backend.root, folder.parent, folder]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
    for name in m["files"]:
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o600
    assert stat.S_IMODE((folder / MANIFEST).stat().st_mode) == 0o600
    assert (folder / "dump.log").exists()

    assert (await backend.latest("alice", "gpu-1")).id == info.id
    assert backend.reserved_ports() == {tree.port}

    pid, ip, port = await restore_and_track(backend, tree, info)
    assert (ip, port) == ("127.0.0.1", tree.port)
    after = await tree.ask("get")
    assert after["secret"] == before["secret"] and after["count"] == 2 and after["child_alive"]
    assert Manifest.load(folder).status == "restored"
    assert await backend.latest("alice", "gpu-1") is None  # never restored twice
    assert backend.reserved_ports() == set()

    # and it can be suspended again from its restored state
    info2 = await backend.checkpoint(server_of(tree, name="gpu-1"))
    assert not is_alive(pid)
    await restore_and_track(backend, tree, info2)
    assert (await tree.ask("inc"))["count"] == 3


async def test_failed_verification_never_kills(backend, process_tree, tmp_path):
    tree = process_tree(pidns=True)
    await tree.wait_ready()
    before = await tree.ask("inc")
    # The disk "loses" a file between CRIU finishing and our checksums.
    backend.dump_extra_args = [
        "--action-script",
        action_script(tmp_path, 'rm -f "$CRTOOLS_IMAGE_DIR/pstree.img"'),
    ]
    with pytest.raises(CheckpointError, match="(?s)verification failed.*pstree.img.*keeps running"):
        await backend.checkpoint(server_of(tree))
    assert is_alive(tree.pid) and not is_frozen(tree.pid)
    after = await tree.ask("inc")
    assert after["count"] == before["count"] + 1 and after["secret"] == before["secret"]
    (found,) = await backend.list("alice")
    assert found.status == "failed" and "pstree.img" in found.error
    assert await backend.latest("alice", "") is None


async def test_corrupt_pages_are_caught_after_criu_and_the_tree_killed(backend, process_tree):
    tree = process_tree(pidns=True)
    await tree.wait_ready()
    info = await backend.checkpoint(server_of(tree))
    tree.proc.wait()
    folder = backend.folder(info.id)
    pages = max((p for p in folder.glob("pages-*.img")), key=lambda p: p.stat().st_size)
    data = bytearray(pages.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pages.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"damaged: {pages.name}: sha256"):
        await backend.restore(info)
    # CRIU ran (concurrently with the pages' checksums) and restored the tree ...
    (log,) = folder.glob("restore-*.log")
    assert "Restore finished successfully" in log.read_text(errors="replace")
    # ... which was killed before the server was handed back
    assert not tree_processes(tree)
    assert not listening(tree.port)
    assert backend.restored == {}
    assert Manifest.load(folder).status == "verified"  # the caller marks it failed


async def test_a_corrupt_small_file_stops_the_restore_before_criu(backend, process_tree):
    tree = process_tree(pidns=True)
    await tree.wait_ready()
    info = await backend.checkpoint(server_of(tree))
    tree.proc.wait()
    folder = backend.folder(info.id)
    core = next(folder.glob("core-*.img"))
    data = bytearray(core.read_bytes())
    data[-1] ^= 0x01
    core.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"damaged: {core.name}: sha256"):
        await backend.restore(info)
    assert not list(folder.glob("restore-*.log"))  # criu never ran
    assert not listening(tree.port)


@pytest.mark.parametrize("damage", ["rm -f $D/mm-*.img", ": > $(ls $D/core-*.img | head -1)"])
async def test_an_incomplete_dump_is_not_verified_and_the_tree_resumes(
    backend, process_tree, tmp_path, damage
):
    tree = process_tree(pidns=True)
    await tree.wait_ready()
    before = await tree.ask("inc")
    backend.dump_extra_args = [
        "--action-script",
        action_script(tmp_path, f'D="$CRTOOLS_IMAGE_DIR"; {damage}'),
    ]
    with pytest.raises(
        CheckpointError, match=r"(?s)verification failed.*(mm-|core-).*keeps running"
    ):
        await backend.checkpoint(server_of(tree))
    assert is_alive(tree.pid) and not is_frozen(tree.pid)
    after = await tree.ask("inc")
    assert after["count"] == before["count"] + 1 and after["secret"] == before["secret"]
    (found,) = await backend.list("alice")
    assert found.status == "failed" and ("mm-" in found.error or "empty" in found.error)
    assert await backend.latest("alice", "") is None


async def test_read_back_verification_and_a_durable_sealed_image(backend, process_tree):
    tree = process_tree(pidns=True)
    await tree.wait_ready()
    before = await tree.ask("inc")
    backend.verify_read_back = True
    backend.chunk_bytes = 1 << 16  # several chunks per pages file
    info = await backend.checkpoint(server_of(tree))
    tree.proc.wait()
    folder = backend.folder(info.id)
    m = Manifest.load(folder)
    assert m.verification == "read-back" and m.chunk_bytes == 1 << 16
    assert m.sizes == {n: (folder / n).stat().st_size for n in m.files}
    assert m.image_bytes == sum(m.sizes.values()) and m.seal_seconds is not None
    assert check_complete(folder) == []
    pages = max(folder.glob("pages-*.img"), key=lambda p: p.stat().st_size)
    assert m.sizes[pages.name] > 2 * m.chunk_bytes
    assert m.files[pages.name] == chunked_sha256(pages.read_bytes(), m.chunk_bytes)
    assert verify_checkpoint(folder) == []
    await restore_and_track(backend, tree, info)
    assert (await tree.ask("get"))["count"] == before["count"]


def chunked_sha256(data: bytes, chunk: int) -> str:
    """The manifest's checksum, computed independently: sha256 over the chunks' digests."""
    pieces = [data[i : i + chunk] for i in range(0, max(len(data), 1), chunk)]
    return hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in pieces)).hexdigest()


@pytest.mark.parametrize("threads", [1, 4])
def test_chunked_checksums_round_trip(tmp_path, threads):
    chunk = 1024
    folder = tmp_path / "img"
    folder.mkdir()
    contents = {
        "inventory.img": os.urandom(86),
        "pstree.img": os.urandom(30),
        "pages-1.img": os.urandom(5 * chunk + 7),
        "pages-2.img": os.urandom(chunk),
        "pages-3.img": b"",
        "core-1.img": os.urandom(chunk - 1),
    }
    for name, data in contents.items():
        (folder / name).write_bytes(data)
    (folder / "dump.log").write_text("not an image file\n")
    with ThreadPoolExecutor(threads) as pool:
        files, sizes, total = seal_image(folder, pool, chunk)
        assert files == {n: chunked_sha256(d, chunk) for n, d in contents.items()}
        assert sizes == {n: len(d) for n, d in contents.items()}
        assert total == sum(sizes.values())
        assert all(stat.S_IMODE((folder / n).stat().st_mode) == 0o600 for n in contents)

        m = Manifest(user="alice", server="", created=1.0, files=files, sizes=sizes)
        m.chunk_bytes = chunk
        m.save(folder)
        back = Manifest.load(folder)
        assert (back.files, back.sizes, back.chunk_bytes) == (files, sizes, chunk)
        kw = {"chunk_bytes": chunk, "sizes": sizes, "pool": pool}
        assert verify_image(folder, back.files, **kw) == []

        # one flipped bit in the last chunk of a file is found, and only there
        data = bytearray(contents["pages-1.img"])
        data[-1] ^= 0x80
        (folder / "pages-1.img").write_bytes(bytes(data))
        (problem,) = verify_image(folder, files, **kw)
        assert problem.startswith("pages-1.img: sha256")
        # names= limits the checksums, not the inventory
        assert verify_image(folder, files, names=["core-1.img"], **kw) == []
        (folder / "pages-2.img").unlink()
        assert verify_image(folder, files, names=["core-1.img"], **kw) == ["pages-2.img: missing"]
        (folder / "pages-3.img").write_bytes(b"x")
        assert "pages-3.img: 1 bytes, 0 recorded" in verify_image(folder, files, **kw)

    # manifests from before chunking (chunk_bytes 0): the plain sha256 of each file
    whole = {
        n: hashlib.sha256((folder / n).read_bytes()).hexdigest()
        for n in ["core-1.img", "inventory.img", "pstree.img"]
    }
    (folder / "pages-1.img").unlink()
    (folder / "pages-3.img").unlink()
    assert verify_image(folder, whole) == []


def test_writeback_starts_the_disk_writes_of_growing_pages_files(tmp_path):
    folder = tmp_path / "img"
    folder.mkdir()
    data = os.urandom(1 << 20)
    with Writeback(folder, interval=0.01, min_bytes=1 << 20) as wb:
        with open(folder / "pages-1.img", "wb") as f:
            for _ in range(12):  # a file growing as CRIU writes it
                f.write(data)
                f.flush()
                time.sleep(0.01)
        (folder / "core-1.img").write_bytes(data)  # small files are left to the fsync
        deadline = time.monotonic() + 30
        while wb.requested < 12 << 20:
            assert time.monotonic() < deadline, wb.requested
            time.sleep(0.01)
    assert wb.requested == 12 << 20
    assert (folder / "pages-1.img").read_bytes() == data * 12  # nothing changed in the file


def test_check_complete_needs_every_part_and_the_success_line(tmp_path):
    folder = tmp_path / "img"
    folder.mkdir()
    for name in ["inventory.img", "pstree.img", "files.img", "fdinfo-2.img", "core-1.img",
                 "mm-1.img", "pagemap-1.img", "pages-1.img"]:  # fmt: skip
        (folder / name).write_bytes(b"\x01\x02\x03\x04")
    log = folder / "dump.log"
    log.write_text("(00.1) Writing stats\n(00.2) Dumping finished successfully\n")
    assert check_complete(folder) == []
    (folder / "pages-1.img").write_bytes(b"")  # a pages file may be empty
    assert check_complete(folder) == []
    log.write_text("(00.1) Error (criu/cr-dump.c:2100): Dumping FAILED.\n")
    assert check_complete(folder) == ["dump.log: does not end with 'Dumping finished successfully'"]
    log.write_text("(00.2) Dumping finished successfully\n")
    (folder / "pagemap-1.img").unlink()
    (folder / "files.img").write_bytes(b"")
    assert check_complete(folder) == [
        "pagemap-*.img: missing",
        "files.img: empty",
        "pagemap-1.img: missing (process 1 has mm-1.img)",
    ]


def tree_processes(tree) -> list[int]:
    """Live processes running the test tree's program (any pid namespace)."""
    script = str(tree.root / "tree.py")
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and script in (p.info["cmdline"] or []):
            found.append(p.pid)
    return found


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


async def test_dump_failure_leaves_it_running(backend, process_tree, tmp_path):
    path = str(tmp_path / "peer.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    tree = process_tree(pidns=True, unix_peer=path)
    await tree.wait_ready()
    peer, _ = listener.accept()
    before = await tree.ask("inc")
    with pytest.raises(
        CheckpointError, match="(?s)criu dump of pid .* failed.*External socket.*keeps running"
    ):
        await backend.checkpoint(server_of(tree))
    after = await tree.ask("inc")
    assert after["count"] == before["count"] + 1 and not is_frozen(tree.pid)
    (found,) = await backend.list()
    assert found.status == "failed" and "Error" in found.error
    assert (backend.folder(found.id) / "dump.log").exists()  # kept for diagnosis
    peer.close()
    listener.close()


async def test_refusals_change_nothing(backend, process_tree, tmp_path):
    tree = process_tree(pidns=True)
    await tree.wait_ready()
    server = server_of(tree)

    backend.min_free_bytes = 1 << 60
    with pytest.raises(CheckpointRefused, match="not enough disk.*min_free_bytes"):
        await backend.checkpoint(server)
    backend.min_free_bytes = 0

    no_criu = LocalBackend(checkpoint_dir=backend.checkpoint_dir, criu_path=str(tmp_path / "nope"))
    with pytest.raises(CheckpointRefused, match="install-criu.sh"):
        await no_criu.checkpoint(server)

    with pytest.raises(CheckpointRefused, match="not running"):
        await backend.checkpoint(Server(user="alice", state={"pid": 2**22 + 7}))
    with pytest.raises(CheckpointRefused, match="no pid"):
        await backend.checkpoint(Server(user="alice"))

    assert await backend.list() == []
    assert not is_frozen(tree.pid) and (await tree.ask("get"))["count"] == 0


async def test_retention_keeps_what_a_restore_needs(backend, process_tree):
    tree = process_tree(pidns=True)
    await tree.wait_ready()
    ids = []
    for i in range(3):
        info = await backend.checkpoint(server_of(tree))
        ids.append(info.id)
        if i < 2:
            await restore_and_track(backend, tree, info)
            await tree.ask("inc")
    # alice/ is suspended now (newest checkpoint verified); two older ones are "restored"
    backend.keep_last = 2
    assert await backend.apply_retention() == [ids[0]]
    assert [c.id for c in await backend.list()] == [ids[2], ids[1]]

    backend.max_age_days = 0  # everything is "too old" ...
    assert await backend.apply_retention() == [ids[1]]
    # ... but the suspended server's newest verified checkpoint stays
    assert [c.id for c in await backend.list()] == [ids[2]]
    await restore_and_track(backend, tree, await backend.latest("alice", ""))
    assert (await tree.ask("get"))["count"] == 2
    # restored: no longer protected
    assert await backend.apply_retention() == [ids[2]]
    assert await backend.list() == [] and not (backend.root / "alice").exists()


async def test_wait_settled_waits_for_a_suspension_in_progress(backend, process_tree, tmp_path):
    tree = process_tree(pidns=True)
    await tree.wait_ready()
    go = tmp_path / "go"
    backend.dump_extra_args = [
        "--action-script",
        action_script(tmp_path, f"while [ ! -e {go} ]; do sleep 0.05; done"),
    ]
    task = asyncio.ensure_future(backend.checkpoint(server_of(tree)))
    while await backend.writing("alice", "") is None:
        await asyncio.sleep(0.05)
    pending = await backend.wait_settled("alice", "", timeout=0.3)
    assert pending is not None and pending.status == "writing"
    with pytest.raises(CheckpointRefused, match="already being written"):
        await backend.check(server_of(tree))
    waiter = asyncio.ensure_future(backend.wait_settled("alice", "", timeout=60, interval=0.05))
    await asyncio.sleep(0.3)
    assert not waiter.done()
    go.touch()
    assert await waiter is None
    info = await task
    assert info.status == "verified"
    await restore_and_track(backend, tree, info)


def criu_running(images: str) -> bool:
    for p in psutil.process_iter(["name", "cmdline", "status"]):
        if p.info["name"] == "criu" and p.info["status"] != psutil.STATUS_ZOMBIE:
            if any(images in arg for arg in p.info["cmdline"] or []):
                return True
    return False


RUN_CHECKPOINT = r"""
import asyncio, sys
from jupyterhub_gpusnap.checkpoint.local import LocalBackend
from jupyterhub_gpusnap.model import Server
b = LocalBackend(checkpoint_dir=sys.argv[1], min_free_bytes=0, dump_extra_args=["--action-script", sys.argv[3]])
asyncio.run(b.checkpoint(Server(user="alice", state={"pid": int(sys.argv[2])})))
"""


@pytest.mark.faults
@pytest.mark.parametrize("dump_ok", [True, False])
async def test_recover_after_the_service_died_mid_dump(backend, process_tree, tmp_path, dump_ok):
    tree = process_tree(pidns=True)
    await tree.wait_ready()
    before = await tree.ask("inc")
    go = tmp_path / "go"
    hook = action_script(
        tmp_path, f"while [ ! -e {go} ]; do sleep 0.05; done\nexit {0 if dump_ok else 1}"
    )
    service = subprocess.Popen(
        [sys.executable, "-c", RUN_CHECKPOINT, backend.checkpoint_dir, str(tree.pid), hook]
    )
    deadline = time.monotonic() + 30
    while not list(backend.root.glob("alice/_default/*/dump.log")):
        assert time.monotonic() < deadline and service.poll() is None
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    service.kill()  # the service dies while CRIU is at post-dump
    service.wait()
    go.touch()
    # let the orphaned criu finish (or fail) its dump
    deadline = time.monotonic() + 30
    while criu_running(backend.checkpoint_dir):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    (pending,) = await backend.list()
    assert pending.status == "writing"

    assert await backend.recover() == [pending.id]
    (after,) = await backend.list()
    if dump_ok:
        assert after.status == "verified"
        assert not is_alive(tree.pid)
        tree.proc.wait()
        await restore_and_track(backend, tree, after)
        got = await tree.ask("get")
        assert got["count"] == before["count"] and got["secret"] == before["secret"]
    else:
        assert after.status == "failed" and "service stopped" in after.error
        got = await tree.ask("inc")  # resumed, same memory
        assert got["count"] == before["count"] + 1


def test_names_are_safe_path_components():
    assert encode_name("") == "_default"
    assert encode_name("_default") != "_default"
    assert encode_name("..") == "%2E."
    assert "/" not in encode_name("a/b") and encode_name("a@b.c") == "a%40b.c"
    assert os.sep not in encode_name("x" + os.sep)


async def test_a_caller_giving_up_does_not_abort_the_checkpoint(backend, process_tree, tmp_path):
    tree = process_tree(pidns=True)
    await tree.wait_ready()
    go = tmp_path / "go"
    backend.dump_extra_args = [
        "--action-script",
        action_script(tmp_path, f"while [ ! -e {go} ]; do sleep 0.05; done"),
    ]
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(backend.checkpoint(server_of(tree)), 0.5)
    # the checkpoint goes on in the background (CRIU waits in the hook): not abandoned
    deadline = time.monotonic() + 30
    while await backend.writing("alice", "") is None:
        assert time.monotonic() < deadline, "the checkpoint stopped with its caller"
        await asyncio.sleep(0.05)
    while not criu_running(backend.checkpoint_dir):
        assert time.monotonic() < deadline, "criu is not dumping"
        await asyncio.sleep(0.05)
    go.touch()
    assert await backend.wait_settled("alice", "", timeout=30, interval=0.05) is None
    (info,) = await backend.list()
    assert info.status == "verified" and not is_alive(tree.pid)
    tree.proc.wait()
    await restore_and_track(backend, tree, info)
    assert (await tree.ask("get"))["count"] == 0


async def test_a_failed_restore_is_kept_max_age_days_whatever_keep_last_says(backend, process_tree):
    """A snapshot whose restore failed is what an admin rescues work from (the email says
    "kept for N days"): keep_last does not count it, max_age_days from the failure does."""
    tree = process_tree(pidns=True)
    await tree.wait_ready()
    info = await backend.checkpoint(server_of(tree))
    folder = backend.folder(info.id)
    pages = next(folder.glob("pages-*.img"))
    data = bytearray(pages.read_bytes())
    data[len(data) // 2] ^= 0xFF
    pages.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="damaged"):
        await backend.restore(info)
    await backend.mark(info.id, "failed", "restore failed: damaged")  # as the spawner does
    failed = await backend.get(info.id)
    assert failed.extra["retention_days"] == 30 == backend.retention_days
    # the user goes on with a fresh server, suspended and restored several times
    tree = process_tree(pidns=True)
    await tree.wait_ready()
    later = []
    for _ in range(3):
        later.append((await backend.checkpoint(server_of(tree))).id)
        await restore_and_track(backend, tree, await backend.latest("alice", ""))
    assert (await backend.get(later[-1])).extra["retention_days"] is None  # kept until restored
    backend.keep_last = 1
    assert await backend.apply_retention() == [later[1], later[0]]
    assert [c.id for c in await backend.list()] == [later[2], info.id]
    # max_age_days after the failure (not after the suspension) it goes
    backend.max_age_days = 1
    assert await backend.apply_retention() == []
    m = Manifest.load(folder)
    m.extra["failed_at"] -= 86400 + 60  # a day has passed
    m.save(folder)
    assert await backend.apply_retention() == [info.id]
