"""LocalBackend with storage = "chunks" (and encryption at rest): real CRIU, real trees."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from jupyterhub_gpusnap.checkpoint import CheckpointError
from jupyterhub_gpusnap.checkpoint.chunks import STORE
from jupyterhub_gpusnap.checkpoint.keys import KeyFileError, new_key_line
from jupyterhub_gpusnap.checkpoint.local import LocalBackend
from jupyterhub_gpusnap.checkpoint.manifest import MANIFEST, Manifest
from jupyterhub_gpusnap.keys_cli import keys_in_use
from jupyterhub_gpusnap.keys_cli import main as keys_main
from jupyterhub_gpusnap.model import Server
from jupyterhub_gpusnap.unpack_cli import main as unpack_main
from tests.helpers.process_tree import TREE_PROGRAM

pytestmark = pytest.mark.criu

TOKEN = "tok-3f9a1c0e7d5b4a2e"


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text(new_key_line("k1") + "\n")
    path.chmod(0o600)
    return path


def make_backend(tmp_path, **kw):
    kw.setdefault("average_chunk_bytes", 64 << 10)  # small trees: small chunks
    return LocalBackend(
        checkpoint_dir=str(tmp_path / "ckpt"), min_free_bytes=0, storage="chunks", **kw
    )


def server_of(tree):
    return Server(user="alice", name="", state={"pid": tree.pid})


async def test_encrypted_chunks_round_trip_share_and_sweep(
    tmp_path, process_tree, key_file, monkeypatch, capsys
):
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", TOKEN)
    backend = make_backend(
        tmp_path, encryption_key_file=str(key_file), keep_last=1, restore_pipe_bytes=256 << 10
    )
    tree = process_tree(pidns=True)
    await tree.wait_ready()
    before = await tree.ask("inc")

    info = await backend.checkpoint(server_of(tree))
    assert info.status == "verified"
    folder = backend.folder(info.id)
    m = Manifest.load(folder)
    assert m.storage == "chunks" and m.key_id == "k1" and info.extra["encrypted"]
    assert m.new_bytes > 0 and m.stored_bytes > 0 and m.image_bytes > 0
    assert not list(folder.glob("*.img")), "raw image files stay after packing"
    # Secrets at rest: neither the token nor the server's memory is readable on disk.
    assert TOKEN not in (folder / MANIFEST).read_text()
    secret = json.dumps(before["secret"]).encode()
    for chunk in (backend.root / STORE).rglob("*"):
        if chunk.is_file():
            assert stat.S_IMODE(chunk.stat().st_mode) == 0o600
            data = chunk.read_bytes()
            assert TOKEN.encode() not in data and secret not in data
    assert await backend.resume_token(info.id) == TOKEN

    tree.pid = (await backend.restore(info)).pid
    after = await tree.ask("inc")
    assert after["secret"] == before["secret"] and after["count"] == before["count"] + 1
    assert not list(folder.glob("*.img")), "unpacked files stay after the restore"
    # streamed: CRIU's files came through pipes of the configured size
    phases = Manifest.load(folder).extra["restore_phases"]
    assert phases["pipe_bytes"] == 256 << 10
    assert phases["stream_waited_storage_s"] >= 0 and phases["stream_waited_criu_s"] >= 0
    # the library pages CRIU wrote into were read ahead, placed by map files unpacked for it
    assert phases["file_pages_bytes"] > 0

    # The same server suspended again: most of its memory is already stored.
    info2 = await backend.checkpoint(server_of(tree))
    m2 = Manifest.load(backend.folder(info2.id))
    assert m2.new_bytes < m2.stored_bytes / 2

    # Retention (keep_last=1) deletes the first checkpoint; the sweep keeps what the
    # second one shares with it and deletes only the rest.
    def stored():
        return {
            p.name for p in (backend.root / STORE).rglob("*") if p.is_file() and p.name != ".lock"
        }

    before_sweep = stored()
    assert await backend.apply_retention() == [info.id]
    left = stored()
    assert left < before_sweep  # the first checkpoint's own chunks are gone
    assert {c for refs in m2.chunks.values() for c, _ in refs} == left
    tree.pid = (await backend.restore(info2)).pid
    assert (await tree.ask("get"))["count"] == after["count"]

    # Recovery by hand: the remaining checkpoint written out as CRIU files.
    out = tmp_path / "by-hand"
    assert unpack_main([str(backend.folder(info2.id)), str(out), "--key-file", str(key_file)]) == 0
    assert {p.name for p in out.iterdir()} == set(m2.files)
    capsys.readouterr()
    assert unpack_main([str(backend.folder(info2.id)), str(tmp_path / "x")]) == 1  # no key
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "'k1', which is not in the key file" in err
    assert keys_in_use(backend.root) == {"k1": 1}
    assert keys_main(["--checkpoint-dir", str(backend.root), "--key-file", str(key_file)]) == 0
    other = tmp_path / "other-keys"
    other.write_text(new_key_line("k2") + "\n")
    other.chmod(0o600)
    assert keys_main(["--checkpoint-dir", str(backend.root), "--key-file", str(other)]) == 1
    assert "put the key back" in capsys.readouterr().out


# The test tree, also holding 8 MiB of random bytes (stored as raw chunks, which a streamed
# restore splices from the chunk files) and reporting their sha256 on every request.
RANDOM_TREE = TREE_PROGRAM.replace(
    'state = {"secret"', 'import hashlib\nballast = os.urandom(8 << 20)\nstate = {"secret"'
).replace("reply = dict(state,", "reply = dict(state, ballast=hashlib.sha256(ballast).hexdigest(),")


async def test_incompressible_memory_is_spliced_checked_and_restored_intact(tmp_path, process_tree):
    backend = make_backend(tmp_path)
    tree = process_tree(pidns=True, program=RANDOM_TREE)
    await tree.wait_ready()
    before = await tree.ask("inc")
    info = await backend.checkpoint(server_of(tree))
    m = Manifest.load(backend.folder(info.id))
    store = backend.chunk_store()
    raw = []
    for refs in m.chunks.values():
        for cid, length in refs:
            opened = store.open_raw("plain", cid, length)
            if opened:
                os.close(opened[0])
                raw.append((cid, length))
    assert sum(n for _, n in raw) >= 7 << 20, "the random bytes are stored as raw chunks"
    # one raw chunk damaged: the streamed restore names it and leaves nothing running
    cid = raw[len(raw) // 2][0]
    blob = backend.root / STORE / "plain" / cid[:2] / cid
    good = blob.read_bytes()
    blob.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(CheckpointError, match=f"damaged.*{cid[:12]}"):
        await backend.restore(info)
    with pytest.raises(OSError):
        await tree.ask("get", timeout=3)
    blob.write_bytes(good)
    tree.pid = (await backend.restore(info)).pid
    after = await tree.ask("get")
    assert after["ballast"] == before["ballast"] and after["count"] == before["count"]


@pytest.mark.parametrize("staging", ["stream", "memory", "folder"])
async def test_a_damaged_chunk_stops_the_restore(tmp_path, process_tree, staging, request):
    """Streamed: CRIU gets every chunk up to the damaged one, then a short file, and fails;
    unpacked first (memory, folder): CRIU never runs. Either way nothing runs afterwards."""
    stage = Path(tempfile.mkdtemp(prefix="stage-"))  # short: the streamer's socket lives here
    request.addfinalizer(lambda: shutil.rmtree(stage, ignore_errors=True))
    backend = make_backend(
        tmp_path,
        restore_streaming=staging == "stream",
        restore_staging_dir=str(stage) if staging != "folder" else "",
    )
    tree = process_tree(pidns=True)
    await tree.wait_ready()
    await tree.ask("inc")
    info = await backend.checkpoint(server_of(tree))
    m = Manifest.load(backend.folder(info.id))
    cid = max((c for refs in m.chunks.values() for c in refs), key=lambda c: c[1])[0]
    blob = backend.root / STORE / "plain" / cid[:2] / cid
    data = bytearray(blob.read_bytes())
    data[-100] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"damaged.*{cid[:12]}"):
        await backend.restore(info)
    if staging == "stream":
        with pytest.raises(OSError):  # the tree CRIU began is gone: nobody answers its port
            await tree.ask("get", timeout=3)
    else:
        assert not list(backend.folder(info.id).glob("restore-*.log")), (
            "CRIU ran on a damaged image"
        )
    assert not list(backend.folder(info.id).glob("*.img"))
    assert not list(stage.iterdir()), "unpacked files or the streamer's folder left behind"
    # Mended (the chunk written again from the same data), it restores from either place.
    blob.write_bytes(bytes(data[:-100]) + bytes([data[-100] ^ 0xFF]) + bytes(data[-99:]))
    tree.pid = (await backend.restore(info)).pid
    assert (await tree.ask("get"))["count"] == 1
    assert list(backend.folder(info.id).glob("restore-*.log")), "CRIU's restore log is kept"
    assert not list(stage.iterdir()) and not list(backend.folder(info.id).glob("*.img"))


async def test_rotation_without_the_old_key_names_the_fix(tmp_path, process_tree, key_file):
    backend = make_backend(tmp_path, encryption_key_file=str(key_file))
    tree = process_tree(pidns=True)
    await tree.wait_ready()
    info = await backend.checkpoint(server_of(tree))
    key_file.write_text(new_key_line("k2") + "\n")  # the old key was dropped too early
    with pytest.raises(CheckpointError, match="'k1'.*encryption_key_file"):
        await backend.restore(info)
    assert Manifest.load(backend.folder(info.id)).status == "verified"  # still restorable


def test_a_pipe_size_out_of_range_names_the_setting():
    for bad in (4096, 1 << 30):
        with pytest.raises(Exception, match=r"restore_pipe_bytes = \d+: use 65536 to 268435456"):
            LocalBackend(restore_pipe_bytes=bad)


def test_encryption_needs_chunks_and_a_private_key_file(tmp_path, key_file):
    with pytest.raises(KeyFileError, match="storage = 'chunks'"):
        LocalBackend(checkpoint_dir=str(tmp_path), encryption_key_file=str(key_file))
    os.chmod(key_file, 0o640)
    with pytest.raises(KeyFileError, match="chmod 600"):
        make_backend(tmp_path, encryption_key_file=str(key_file))


async def test_setup_removes_images_an_interrupted_restore_left_unpacked(tmp_path):
    stage = tmp_path / "stage"
    old, fresh = stage / "gpusnap-restore-old", stage / "gpusnap-restore-new"
    for d in (old, fresh):
        d.mkdir(parents=True)
        (d / "pages-1.img").write_bytes(b"memory")
    os.utime(old, (1, 1))
    other = stage / "someone-elses"
    other.mkdir()
    os.utime(other, (1, 1))
    await make_backend(tmp_path, restore_staging_dir=str(stage)).setup()
    assert not old.exists() and fresh.exists() and other.exists()


async def test_a_failed_encrypted_checkpoint_leaves_no_plaintext_memory(
    tmp_path, process_tree, key_file
):
    """CRIU wrote the raw image (the server's memory, unencrypted) and then the dump failed:
    the server runs on and none of those files stay on the disk, at once or after a crash
    of the service mid-dump (recover)."""
    hook = tmp_path / "fail-after-pages.sh"
    hook.write_text('#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] && exit 1\nexit 0\n')
    hook.chmod(0o700)
    backend = make_backend(
        tmp_path, encryption_key_file=str(key_file), dump_extra_args=["--action-script", str(hook)]
    )
    tree = process_tree(pidns=True)
    await tree.wait_ready()
    before = await tree.ask("inc")
    with pytest.raises(CheckpointError, match="raw image files"):
        await backend.checkpoint(server_of(tree))
    (folder,) = [p.parent for p in backend.root.glob("alice/*/*/" + MANIFEST)]
    m = Manifest.load(folder)
    assert m.status == "failed" and m.storage == "chunks"
    assert not list(folder.glob("pages-*.img")) and not list(folder.glob("*.img"))
    assert (folder / "dump.log").exists()  # the log stays for diagnosis
    assert (await tree.ask("inc"))["count"] == before["count"] + 1  # the server runs on

    # a service killed mid-dump: the manifest still says "writing", raw pages on the disk
    (folder / "pages-1.img").write_bytes(b"\0" * 4096 + TOKEN.encode())
    m.status = "writing"
    m.save(folder)
    fresh = make_backend(tmp_path, encryption_key_file=str(key_file))
    await fresh.recover()
    assert Manifest.load(folder).status == "failed"
    assert not list(folder.glob("pages-*.img")), "plaintext memory left after recovery"
