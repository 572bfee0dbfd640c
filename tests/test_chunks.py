"""The chunk store and the key file: real files, real zstd, real AES-GCM."""

from __future__ import annotations

import os
import random
import stat
from concurrent.futures import ThreadPoolExecutor

import pytest

from jupyterhub_gpusnap.checkpoint.chunks import PAGE, ChunkStore, cut_points
from jupyterhub_gpusnap.checkpoint.keys import Key, KeyFileError, load_keys, new_key_line


@pytest.fixture
def pool():
    with ThreadPoolExecutor(4) as p:
        yield p


def pages(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n * PAGE)


def weights(n_bytes: int, seed: int) -> bytes:
    """bf16-like weights: random mantissas, a narrow band of exponents (compressible)."""
    out = bytearray(random.Random(seed).randbytes(n_bytes))
    exponent = bytes(0x3C + (x & 3) for x in range(256))  # sign 0, exponents near 1e-2
    out[1::2] = out[1::2].translate(exponent)
    return bytes(out)


def pack_one(store: ChunkStore, path):
    return store.pack([path])[path.name]


def test_cuts_follow_the_content_not_the_offset():
    data = pages(3000, 1)
    shifted = pages(7, 2) + data  # seven pages more in front
    a = {data[c : c + PAGE] for c in cut_points(data)[1:]}
    b = {shifted[c : c + PAGE] for c in cut_points(shifted)[1:]}
    assert len(a) > 2
    # after the first cut or two, the same pages start chunks in both
    assert len(a & b) >= len(a) - 2


def test_round_trip_dedup_and_compression(tmp_path, pool):
    store = ChunkStore(tmp_path / ".chunks", pool, avg_pages=64)  # small chunks: small data
    src = tmp_path / "a"
    src.mkdir()
    model = weights(3 << 20, 7)
    noise = pages(600, 3)
    (src / "pages-1.img").write_bytes(model + noise + bytes(1 << 20))
    (src / "core-1.img").write_bytes(b"core" * 10)
    first = store.pack(sorted(src.iterdir()))
    big = first["pages-1.img"]
    assert big.size == len(model) + len(noise) + (1 << 20)
    assert len(big.chunks) > 3
    assert big.new_bytes < big.size * 0.95  # weights and zeros compress, noise does not
    # The same model in another server, at another offset: stored once.
    other = tmp_path / "b"
    other.mkdir()
    (other / "pages-9.img").write_bytes(pages(5, 99) + model + noise)
    second = pack_one(store, other / "pages-9.img")
    assert second.new_bytes < (5 * PAGE + len(model)) * 0.25
    for folder, packed in ((src, first), (other, {"pages-9.img": second})):
        out = tmp_path / f"out-{folder.name}"
        out.mkdir()
        chunks = {n: p.chunks for n, p in packed.items()}
        sizes = {n: p.size for n, p in packed.items()}
        assert store.unpack(store.space, chunks, sizes, out) == []
        for name in chunks:
            assert (out / name).read_bytes() == (folder / name).read_bytes()
    for chunk in (tmp_path / ".chunks").rglob("*"):
        if chunk.is_file():
            assert stat.S_IMODE(chunk.stat().st_mode) == 0o600


def test_a_damaged_or_missing_chunk_is_named(tmp_path, pool):
    store = ChunkStore(tmp_path / ".chunks", pool, avg_pages=64)
    path = tmp_path / "pages-1.img"
    path.write_bytes(pages(800, 5))
    packed = pack_one(store, path)
    cid = packed.chunks[1][0]
    blob = store.path("plain", cid)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))
    out = tmp_path / "out"
    out.mkdir()
    chunks = {"pages-1.img": packed.chunks}
    problems = store.unpack("plain", chunks, {"pages-1.img": packed.size}, out)
    assert len(problems) == 1 and cid[:12] in problems[0] and "checksum" in problems[0]
    assert store.check("plain", chunks) == problems
    blob.unlink()
    (problem,) = store.unpack("plain", chunks, {"pages-1.img": packed.size}, out)
    assert "missing" in problem


def test_raw_chunks_open_for_splicing_only_once_checked(tmp_path, pool):
    """open_raw: incompressible plain chunks come back as (fd, offset) after their check;
    compressed ones are left to get(); damage of any kind is named like get() names it."""
    store = ChunkStore(tmp_path / ".chunks", pool, avg_pages=64)
    rnd, comp = tmp_path / "pages-1.img", tmp_path / "pages-2.img"
    rnd.write_bytes(pages(300, 6))
    comp.write_bytes(weights(300 * PAGE, 7))
    packed = store.pack([rnd, comp])
    cid, length = packed["pages-1.img"].chunks[0]
    fd, offset = store.open_raw("plain", cid, length)
    try:
        assert os.pread(fd, length, offset) == rnd.read_bytes()[:length]
    finally:
        os.close(fd)
    assert store.open_raw("plain", *packed["pages-2.img"].chunks[0]) is None  # zstd: get()
    blob = store.path("plain", cid)
    good = blob.read_bytes()
    for bad in (good[:-1], good + b"\0", good[:100] + bytes([good[100] ^ 1]) + good[101:]):
        blob.write_bytes(bad)
        with pytest.raises(ValueError, match="checksum"):
            store.open_raw("plain", cid, length)
    blob.write_bytes(b"junk")
    with pytest.raises(ValueError, match="damaged header"):
        store.open_raw("plain", cid, length)
    blob.unlink()
    with pytest.raises(ValueError, match="missing"):
        store.open_raw("plain", cid, length)


def test_every_chunk_opens_as_a_file_to_splice(tmp_path, pool):
    """open_chunk: a raw chunk is its own file (past the header); a compressed or sealed one
    is decoded into a memory file; damage is named and leaves no descriptor open."""
    key = Key("2026-11", os.urandom(32))
    store = ChunkStore(tmp_path / ".chunks", pool, avg_pages=64)
    sealed = ChunkStore(tmp_path / ".chunks", pool, avg_pages=64, keys=[key])
    rnd, comp = tmp_path / "pages-1.img", tmp_path / "pages-2.img"
    rnd.write_bytes(pages(300, 6))
    comp.write_bytes(weights(300 * PAGE, 7))
    packed = store.pack([rnd, comp])
    comp_sealed = pack_one(sealed, comp)
    cases = [  # (store, space, chunks, which, source, what the descriptor is)
        (store, "plain", packed["pages-1.img"].chunks, 0, rnd, "chunk file"),
        (store, "plain", packed["pages-2.img"].chunks, 1, comp, "memory file"),
        (sealed, key.id, comp_sealed.chunks, 1, comp, "memory file"),
    ]
    for st, space, refs, i, src, kind in cases:
        cid, length = refs[i]
        start = sum(n for _, n in refs[:i])
        fd, offset = st.open_chunk(space, cid, length)
        try:
            assert os.pread(fd, length, offset) == src.read_bytes()[start : start + length]
            assert os.fstat(fd).st_size == offset + length
            target = os.readlink(f"/proc/self/fd/{fd}")
            assert ("memfd:gpusnap-chunk" if kind != "chunk file" else cid) in target
        finally:
            os.close(fd)
    cid, length = packed["pages-2.img"].chunks[1]
    blob = store.path("plain", cid)
    good = blob.read_bytes()
    blob.write_bytes(good[:-3] + bytes(3))
    open_fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ValueError, match="decompress|checksum"):
        store.open_chunk("plain", cid, length)
    assert len(os.listdir("/proc/self/fd")) == open_fds


def test_encrypted_chunks_hide_the_data_and_need_the_key(tmp_path, pool):
    old, new = Key("2026-05", os.urandom(32)), Key("2026-11", os.urandom(32))
    secret = b"password=hunter2;" * 20000
    path = tmp_path / "pages-1.img"
    path.write_bytes(secret)
    sealed_old = pack_one(ChunkStore(tmp_path / ".chunks", pool, keys=[old]), path)
    # Nothing on disk shows the plaintext, compressed or not.
    for chunk in (tmp_path / ".chunks" / "2026-05").rglob("*"):
        if chunk.is_file():
            assert b"hunter2" not in chunk.read_bytes()
    # Rotation: the new key seals new chunks, the old key still opens old ones.
    rotated = ChunkStore(tmp_path / ".chunks", pool, keys=[new, old])
    assert rotated.space == "2026-11"
    out = tmp_path / "out"
    out.mkdir()
    chunks = {"pages-1.img": sealed_old.chunks}
    assert rotated.unpack("2026-05", chunks, {"pages-1.img": sealed_old.size}, out) == []
    assert (out / "pages-1.img").read_bytes() == secret
    assert rotated.open_raw("2026-05", *sealed_old.chunks[0]) is None  # sealed: never spliced
    sealed_new = pack_one(rotated, path)
    assert sealed_new.new_bytes > 0  # ids are keyed: no sharing across keys
    # Without the old key: a clear error naming the key and the fix.
    (problem,) = ChunkStore(tmp_path / ".chunks", pool, keys=[new]).unpack(
        "2026-05", chunks, {"pages-1.img": sealed_old.size}, out
    )
    assert "2026-05" in problem and "encryption_key_file" in problem
    # A wrong key under the right id fails authentication.
    impostor = ChunkStore(tmp_path / ".chunks", pool, keys=[Key("2026-05", os.urandom(32))])
    (problem,) = impostor.unpack("2026-05", chunks, {"pages-1.img": sealed_old.size}, out)
    assert "authentication" in problem


def test_sweep_deletes_only_unreferenced_chunks(tmp_path, pool):
    store = ChunkStore(tmp_path / ".chunks", pool, avg_pages=64)
    a, b = tmp_path / "pages-1.img", tmp_path / "pages-2.img"
    a.write_bytes(pages(700, 1))
    b.write_bytes(pages(700, 2))
    pa, pb = pack_one(store, a), pack_one(store, b)
    keep = {("plain", cid) for cid, _ in pa.chunks}
    count, freed = store.sweep(lambda: keep)
    assert count == len({c for c, _ in pb.chunks}) and freed > 0
    out = tmp_path / "out"
    out.mkdir()
    assert store.unpack("plain", {"pages-1.img": pa.chunks}, {"pages-1.img": pa.size}, out) == []
    assert store.sweep(lambda: keep) == (0, 0)
    assert store.sweep(lambda: None) == (0, 0)  # called off: nothing deleted
    assert store.unpack("plain", {"pages-1.img": pa.chunks}, {"pages-1.img": pa.size}, out) == []


def test_no_sweep_while_a_pack_holds_the_store(tmp_path, pool):
    import fcntl

    store = ChunkStore(tmp_path / ".chunks", pool, avg_pages=64)
    a = tmp_path / "pages-1.img"
    a.write_bytes(pages(300, 1))
    packed = pack_one(store, a)
    with store._locked(fcntl.LOCK_SH):  # what pack() holds, from another process too
        assert store.sweep(lambda: set()) == (0, 0)
    out = tmp_path / "out"
    out.mkdir()
    assert store.unpack("plain", {"x": packed.chunks}, {"x": packed.size}, out) == []
    assert store.sweep(lambda: set())[0] == len({c for c, _ in packed.chunks})


def test_key_file_checks(tmp_path):
    path = tmp_path / "keys"
    path.write_text(new_key_line("2026-11") + "\n" + new_key_line("2026-05") + "\n")
    path.chmod(0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        load_keys(path)
    path.chmod(0o600)
    assert [k.id for k in load_keys(path)] == ["2026-11", "2026-05"]
    path.write_text("2026-11 c2hvcnQ=\n")
    with pytest.raises(KeyFileError, match="not 32 bytes"):
        load_keys(path)
    path.write_text("# nothing yet\n")
    with pytest.raises(KeyFileError, match="holds no key"):
        load_keys(path)
    with pytest.raises(KeyFileError, match="keys --new"):
        load_keys(tmp_path / "missing")
    with pytest.raises(KeyFileError, match="key id"):
        new_key_line("bad id")


def test_following_a_growing_file_gives_the_chunks_of_packing_it_whole(tmp_path, pool):
    import threading
    import time

    store = ChunkStore(tmp_path / ".chunks", pool, avg_pages=64)
    folder = tmp_path / "dump"
    folder.mkdir()
    data = pages(4000, 11)  # ~16 MiB, written in pieces like CRIU's page writes
    path = folder / "pages-1.img"
    follower = store.follow(folder, interval=0.01)

    def write():
        with open(path, "wb") as f:
            for i in range(0, len(data), 37 * PAGE):
                f.write(data[i : i + 37 * PAGE])
                f.flush()
                time.sleep(0.002)

    writer = threading.Thread(target=write)
    writer.start()
    writer.join()
    deadline = time.monotonic() + 30
    while not follower.packers.get(path.name) or not follower.packers[path.name].done:
        assert time.monotonic() < deadline, "the follower packed nothing before finish()"
        time.sleep(0.01)
    (folder / "core-1.img").write_bytes(b"core")
    followed = follower.finish(sorted(folder.iterdir()))
    whole = ChunkStore(tmp_path / ".chunks2", pool, avg_pages=64).pack(sorted(folder.iterdir()))
    assert followed["pages-1.img"].chunks == whole["pages-1.img"].chunks
    assert followed["pages-1.img"].size == len(data)
    assert followed["core-1.img"].chunks == whole["core-1.img"].chunks
    out = tmp_path / "out"
    out.mkdir()
    chunks = {n: p.chunks for n, p in followed.items()}
    assert store.unpack("plain", chunks, {n: p.size for n, p in followed.items()}, out) == []
    assert (out / "pages-1.img").read_bytes() == data
    assert store.sweep(lambda: set())[0] > 0  # finish() released the store's lock


def test_packing_step_by_step_cuts_where_packing_whole_does(tmp_path, pool):
    from jupyterhub_gpusnap.checkpoint.chunks import _FilePacker

    store = ChunkStore(tmp_path / ".chunks", pool, avg_pages=64)
    data = pages(3000, 12)
    path = tmp_path / "pages-1.img"
    path.write_bytes(b"")
    packer = _FilePacker(store, path)
    steps = 0
    with open(path, "ab") as f:
        for i in range(0, len(data), 700 * PAGE + 123):  # pieces not page-aligned
            f.write(data[i : i + 700 * PAGE + 123])
            f.flush()
            before = packer.done
            packer.step(final=False)
            steps += packer.done > before
    packer.step(final=True)
    assert steps >= 2  # really packed while growing
    assert packer.result().chunks == store.pack_file(path).chunks
