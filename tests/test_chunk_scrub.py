"""Shared chunks damaged: replicas, verification on write, the scrub. Real CRIU, real trees,
the real chunk store on disk; damage is a bit flipped in a chunk file, as a disk does."""

from __future__ import annotations

import logging
import os

import pytest

from jupyterhub_gpusnap import metrics
from jupyterhub_gpusnap.checkpoint import CheckpointError
from jupyterhub_gpusnap.checkpoint.chunks import STORE
from jupyterhub_gpusnap.checkpoint.keys import new_key_line
from jupyterhub_gpusnap.checkpoint.local import REPLICAS, LocalBackend
from jupyterhub_gpusnap.checkpoint.manifest import Manifest
from jupyterhub_gpusnap.model import Server
from tests.helpers.process_tree import SHARED_TREE
from tests.helpers.shared_chunks import chunk_ids, suspend_two

pytestmark = pytest.mark.criu


def counter(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def damaged(found_by: str, result: str) -> float:
    return counter("gpusnap_chunks_damaged_total", found_by=found_by, result=result)


def flip_bit(path) -> bytes:
    """Flip one bit in the middle of a file (as a bad sector would); its old bytes."""
    good = path.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0x10
    path.write_bytes(bytes(bad))
    return good


def make_backend(tmp_path, **kw) -> LocalBackend:
    kw.setdefault("average_chunk_bytes", 64 << 10)
    return LocalBackend(
        checkpoint_dir=str(tmp_path / "ckpt"), min_free_bytes=0, storage="chunks", **kw
    )


async def restore_both_intact(backend, trees, infos, before):
    for tree, info, was in zip(trees, infos, before, strict=True):
        tree.pid = (await backend.restore(info)).pid
        now = await tree.ask("get")
        assert now["weights"] == was["weights"] and now["secret"] == was["secret"]
        assert now["count"] == was["count"]


async def test_shared_chunk_damaged_scrub_and_restore_repair_it_from_the_replica(
    tmp_path, process_tree
):
    """Two users' snapshots share chunks: the scrub stores those twice (sealed the same
    way); a flipped bit in one is repaired by the full scrub, in another by the restore
    that meets it, and both servers come back intact."""
    keys = tmp_path / "keys"
    keys.write_text(new_key_line("k1") + "\n")
    keys.chmod(0o600)
    backend = make_backend(tmp_path, encryption_key_file=str(keys))
    trees, infos, before, shared = await suspend_two(backend, process_tree)
    store = backend.chunk_store()
    alice_only = set(chunk_ids(backend, infos[0])) - set(shared)

    report = await backend.scrub(full=False)  # the service's hourly call: replicas only
    assert not report["full"] and report["replicated"] == len(shared) and not report["damaged"]
    for cid in shared:
        replica = store.replica_path("k1", cid)
        assert replica.is_file() and replica.read_bytes() == store.path("k1", cid).read_bytes()
        assert replica.parent.parent.parent == backend.root / REPLICAS
    assert not any(store.replica_path("k1", c).exists() for c in alice_only)
    assert (await backend.scrub(full=False))["chunks"] == 0  # nothing left to replicate

    # 1. the scrub finds a damaged shared chunk and repairs it from the replica
    first = store.path("k1", shared[0])
    good = flip_bit(first)
    repaired_before = damaged("scrub", "repaired")
    report = await backend.scrub(full=True)
    assert report["full"] and [r.split(":")[0] for r in report["repaired"]] == [
        f"{shared[0][:12]}…"
    ]
    assert report["damaged"] == [] and report["checkpoints_damaged"] == []
    assert report["bytes_read"] >= report["chunks"] and report["ok"] == report["chunks"] - 1
    assert first.read_bytes() == good
    assert damaged("scrub", "repaired") == repaired_before + 1

    # 2. a restore meets a damaged shared chunk: it reads the replica and repairs the chunk
    second = store.path("k1", shared[1])
    good = flip_bit(second)
    read_before = damaged("read", "repaired")
    await restore_both_intact(backend, trees, infos, before)
    assert second.read_bytes() == good
    assert damaged("read", "repaired") == read_before + 1
    assert [(await backend.get(i.id)).status for i in infos] == ["restored", "restored"]


async def test_damaged_chunk_without_a_replica_is_found_and_reported(
    tmp_path, process_tree, caplog
):
    """A chunk only alice's snapshot lists has no second copy: the scrub cannot repair it,
    so it says so everywhere an admin looks (the checkpoint's status and error, the log,
    the metrics) and alice's next start is a fresh server, not a failed restore. bob's
    snapshot, which does not list that chunk, is untouched."""
    backend = make_backend(tmp_path)
    trees, infos, before, shared = await suspend_two(backend, process_tree)
    store = backend.chunk_store()
    await backend.scrub(full=False)
    only = sorted(set(chunk_ids(backend, infos[0])) - set(shared))[0]
    assert not store.replica_path("plain", only).exists()
    flip_bit(store.path("plain", only))
    lost_before = damaged("scrub", "unrepairable")

    with caplog.at_level(logging.ERROR):
        report = await backend.scrub(full=True)

    assert [d.split(":")[0] for d in report["damaged"]] == [f"{only[:12]}…"]
    assert "no replica" in report["damaged"][0]
    assert report["checkpoints_damaged"] == [infos[0].id]
    alice = await backend.get(infos[0].id)
    assert alice.status == "failed" and "damaged beyond repair" in alice.error
    assert only[:12] in alice.error and "scrub" in alice.error
    assert [d["chunk"] for d in alice.extra["damaged_chunks"]] == [only]
    assert alice.extra["retention_days"] == 30  # kept for rescue, as a failed restore is
    assert await backend.latest("alice", "") is None  # next start: fresh, said why
    assert f"checkpoint {infos[0].id} lists chunk {only[:12]}" in caplog.text
    assert damaged("scrub", "unrepairable") == lost_before + 1
    assert counter("gpusnap_checkpoints_damaged") == 1
    assert counter("gpusnap_scrub_completed_timestamp_seconds") > 0
    with pytest.raises(CheckpointError, match="failed, not verified"):
        await backend.restore(alice)
    # bob's snapshot does not list it: verified, and restores intact
    assert (await backend.get(infos[1].id)).status == "verified"
    trees[1].pid = (await backend.restore(infos[1])).pid
    assert (await trees[1].ask("get"))["weights"] == before[1]["weights"]
    # a second full scrub marks nothing twice
    assert (await backend.scrub(full=True))["checkpoints_damaged"] == []


async def test_a_suspension_repairs_a_damaged_shared_chunk_it_would_have_trusted(
    tmp_path, process_tree
):
    """Verification on write: bob's suspension finds the weights stored already (by
    alice's), reads them back, finds one chunk damaged and stores its own good copy over
    it; alice's snapshot then restores intact too."""
    backend = make_backend(tmp_path, replicate_min_servers=0)  # no replicas: only this helps
    alice_tree = process_tree(pidns=True, program=SHARED_TREE)
    await alice_tree.wait_ready()
    alice_before = await alice_tree.ask("inc")
    alice = await backend.checkpoint(Server(user="alice", name="", state={"pid": alice_tree.pid}))
    store = backend.chunk_store()
    ids = chunk_ids(backend, alice)
    # the chunks another copy of the program shares with alice's (the weights; her heap and
    # stacks differ from run to run): carol's snapshot shows which
    carol_tree = process_tree(pidns=True, program=SHARED_TREE)
    await carol_tree.wait_ready()
    carol = await backend.checkpoint(Server(user="carol", name="", state={"pid": carol_tree.pid}))
    shared = set(ids) & set(chunk_ids(backend, carol))
    biggest = max(shared, key=ids.get)  # part of the weights
    good = flip_bit(store.path("plain", biggest))
    write_before = damaged("write", "repaired")

    bob_tree = process_tree(pidns=True, program=SHARED_TREE)
    await bob_tree.wait_ready()
    bob_before = await bob_tree.ask("inc")
    bob = await backend.checkpoint(Server(user="bob", name="", state={"pid": bob_tree.pid}))

    assert biggest in chunk_ids(backend, bob)
    assert store.path("plain", biggest).read_bytes() == good
    assert damaged("write", "repaired") == write_before + 1
    await restore_both_intact(
        backend, [alice_tree, bob_tree], [alice, bob], [alice_before, bob_before]
    )


async def test_a_sweep_deletes_replicas_no_checkpoint_needs(tmp_path, process_tree):
    backend = make_backend(tmp_path)
    trees, infos, before, shared = await suspend_two(backend, process_tree)
    await backend.scrub(full=False)
    replicas = backend.root / REPLICAS
    assert sum(1 for p in replicas.rglob("*") if p.is_file()) == len(shared)
    await backend.delete(infos[0].id)  # bob's still lists them: kept
    assert sum(1 for p in replicas.rglob("*") if p.is_file()) == len(shared)
    await backend.delete(infos[1].id)
    assert not [p for p in replicas.rglob("*") if p.is_file()]
    assert not [p for p in (backend.root / STORE).rglob("*") if p.is_file() and p.name != ".lock"]


def stored_checkpoint(backend, user: str, data: bytes, status: str = "verified") -> str:
    """A checkpoint of ``data`` written as the backend writes one (chunks packed into the
    real store, a manifest beside them), without a process: for what needs no restore."""
    folder = backend.server_dir(user, "") / f"20261125T0000{len(user):02d}.000000Z"
    folder.mkdir(parents=True)
    (folder / "pages-1.img").write_bytes(data)
    store = backend.chunk_store()
    packed = store.pack([folder / "pages-1.img"])["pages-1.img"]
    (folder / "pages-1.img").unlink()
    Manifest(user=user, server="", created=1.0, status=status, storage="chunks",
             key_id=store.space, chunks={"pages-1.img": packed.chunks}, verified_at=1.0).save(folder)  # fmt: skip
    return backend._id(folder)


async def test_scrub_runs_a_full_pass_when_due_and_checks_what_it_can_open(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(new_key_line("k1") + "\n")
    keys.chmod(0o600)
    backend = make_backend(tmp_path, encryption_key_file=str(keys), scrub_bytes_per_second=0)
    shared = os.urandom(1 << 20)
    stored_checkpoint(backend, "alice", shared + os.urandom(256 << 10))
    stored_checkpoint(backend, "bob", shared)

    first = await backend.scrub()  # never scrubbed: due at once
    assert first["full"] and first["replicated"] > 0 and first["ok"] > 0
    assert first["chunks"] == first["ok"] + first["replicated"]
    again = await backend.scrub()  # a week is not over: replicas only, none missing
    assert not again["full"] and again["chunks"] == 0
    backend.scrub_interval = 1e-9  # due again
    assert (await backend.scrub())["full"]
    backend.scrub_interval = 0  # off: no scheduled full pass
    assert not (await backend.scrub())["full"]
    assert (await backend.scrub(full=True))["full"]  # an admin's pass runs anyway

    # the key is gone: nothing can be checked, and nothing is marked damaged for it
    keys.write_text(new_key_line("k2") + "\n")
    report = await backend.scrub(full=True)
    assert report["unchecked"] == report["chunks"] > 0 and not report["damaged"]
    assert {c.status for c in await backend.list()} == {"verified"}


async def test_an_unpack_by_hand_reads_a_damaged_chunk_from_its_replica(tmp_path, process_tree):
    """`jupyterhub-gpusnap unpack` (recovery by hand) finds the replicas where LocalBackend
    keeps them, as a restore does: a flipped bit in a shared chunk does not stop it."""
    from jupyterhub_gpusnap.unpack_cli import main as unpack_main

    keys = tmp_path / "keys"
    keys.write_text(new_key_line("k1") + "\n")
    keys.chmod(0o600)
    backend = make_backend(tmp_path, encryption_key_file=str(keys))
    trees, infos, before, shared = await suspend_two(backend, process_tree)
    await backend.scrub(full=False)
    store = backend.chunk_store()
    good = flip_bit(store.path("k1", shared[0]))
    out = tmp_path / "by-hand"
    assert unpack_main([str(backend.folder(infos[0].id)), str(out), "--key-file", str(keys)]) == 0
    assert {p.name for p in out.iterdir()} == set(Manifest.load(backend.folder(infos[0].id)).files)
    assert store.path("k1", shared[0]).read_bytes() == good  # and the chunk is mended
