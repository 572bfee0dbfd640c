"""Shared chunk damaged, end to end: a real Hub, proxy, single-user servers and kernels,
CRIU, the chunk store. Two users' kernels hold the same data (the same model loaded twice),
so their snapshots share chunks; the service's scrub call stores those twice; a bit flipped
in two of them on the disk. Both users come back through the Hub to the same kernel with
the same data: the Hub's restore read the replicas and repaired the chunks."""

from __future__ import annotations

import pytest

from jupyterhub_gpusnap.checkpoint.manifest import Manifest
from tests.helpers.local_hub import service_backend, snap_config, suspend

pytestmark = [pytest.mark.e2e, pytest.mark.criu]

# The same 16 MiB in both kernels, page-aligned as a framework's large tensors are (the
# chunk store finds shared data at page granularity: the same bytes at another offset
# within their pages, as malloc may place a bytes object, are not shared).
LOAD = (
    "import hashlib, mmap, random\n"
    "weights = mmap.mmap(-1, 16 << 20)\n"
    "weights.write(random.Random(7).randbytes(16 << 20))\n"
    "x = {x}\n"
    "print(hashlib.sha256(weights).hexdigest())"
)


async def test_two_users_restore_intact_after_a_shared_chunk_is_damaged(hub_factory, tmp_path):
    ckpt = tmp_path / "ckpt"
    hub = await hub_factory(snap_config(ckpt, 'c.LocalBackend.storage = "chunks"'))
    backend = service_backend(ckpt, storage="chunks")
    users = {"alice": 42, "bob": 43}
    kernels, digests, infos = {}, {}, {}
    for user, x in users.items():
        await hub.start_server(user)
        kernels[user], out = await hub.execute(user, LOAD.format(x=x))
        digests[user] = out.strip()
        infos[user] = await suspend(hub, backend, user)
    assert digests["alice"] == digests["bob"]
    chunks = {
        u: {c: n for refs in Manifest.load(backend.folder(i.id)).chunks.values() for c, n in refs}
        for u, i in infos.items()
    }
    shared = sorted(set(chunks["alice"]) & set(chunks["bob"]), key=lambda c: -chunks["alice"][c])
    assert sum(chunks["alice"][c] for c in shared) >= 12 << 20  # the weights, stored once

    report = await backend.scrub()  # what the service's housekeeping calls
    assert report["replicated"] == len(shared) and not report["damaged"]
    store = backend.chunk_store()
    good = {}
    for cid in shared[:2]:  # a bad sector under two of the weights' chunks
        path = store.path("plain", cid)
        good[cid] = path.read_bytes()
        bad = bytearray(good[cid])
        bad[len(bad) // 3] ^= 0x04
        path.write_bytes(bytes(bad))

    for user, x in users.items():
        await hub.start_server(user)
        kid, out = await hub.execute(
            user, "print(hashlib.sha256(weights).hexdigest(), x)", kernel_id=kernels[user]
        )
        assert kid == kernels[user] and out.split() == [digests[user], str(x)]
        assert Manifest.load(backend.folder(infos[user].id)).status == "restored"
    for cid, data in good.items():
        assert store.path("plain", cid).read_bytes() == data  # put back from the replica
    assert "repaired from its replica" in hub.log_text()
