"""The image streamer's parts: CRIU's request/reply framing and the pipe writer that lends
its memory to the pipe (vmsplice). The whole path with real CRIU is in test_local_chunks.py
and test_restore_e2e.py."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jupyterhub_gpusnap.checkpoint.streamer import _LEN, PipeWriter, grow_pipe, parse_request, reply


def test_request_and_reply_framing():
    # img_streamer_request_entry {filename = "pages-1.img"} as protobuf-c packs it
    msg = b"\x0a\x0bpages-1.img"
    assert parse_request(msg) == "pages-1.img"
    assert reply(True) == _LEN.pack(2) + b"\x08\x01"
    assert reply(False) == _LEN.pack(2) + b"\x08\x00"
    with pytest.raises(ValueError, match="without a filename"):
        parse_request(b"\x10\x01")
    with pytest.raises(ValueError, match="truncated"):
        parse_request(b"\x0a\x80")


@pytest.mark.parametrize("splice", [True, False])
def test_pipe_writer_round_trip(splice):
    chunks = [os.urandom(n) for n in (1, 4095, 4096, 300_000, 2 << 20, 7)] * 3
    r, w = os.pipe()
    got = hashlib.sha256()

    def reader():
        while data := os.read(r, 65536):
            got.update(data)

    t = threading.Thread(target=reader)
    t.start()
    pipe = PipeWriter(w, splice=splice)
    for c in chunks:
        assert pipe.write(c)
    pipe.close()
    t.join()
    os.close(r)
    assert got.hexdigest() == hashlib.sha256(b"".join(chunks)).hexdigest()
    assert not pipe.held


def test_spliced_buffers_are_held_until_the_reader_took_them():
    r, w = os.pipe()
    pipe = PipeWriter(w)
    assert pipe.splice, "vmsplice is available on Linux"
    parts = [bytes([i]) * (128 << 10) for i in range(3)]
    for p in parts:
        assert pipe.write(p)
    assert [end for end, _ in pipe.held] == [128 << 10, 256 << 10, 384 << 10]  # nothing read yet
    taken = b""
    while len(taken) < (200 << 10):
        taken += os.read(r, (200 << 10) - len(taken))
    assert pipe.write(b"x")
    assert [end for end, _ in pipe.held] == [256 << 10, 384 << 10, (384 << 10) + 1]  # first one released
    rest = b""
    closer = threading.Thread(target=pipe.close)  # waits for the reader
    closer.start()
    while len(rest) < (184 << 10) + 1:
        rest += os.read(r, 1 << 20)
    closer.join(10)
    assert not closer.is_alive() and not pipe.held
    assert taken + rest == b"".join(parts) + b"x"
    os.close(r)


def test_a_reader_that_went_away_ends_the_writer():
    r, w = os.pipe()
    pipe = PipeWriter(w)
    assert pipe.write(b"a" * 1000)
    os.close(r)
    assert pipe.write(b"b" * (4 << 20)) is False
    pipe.close()  # does not wait for a reader that is gone
    assert not pipe.held


def test_a_pipe_gets_the_size_asked_for_or_the_most_allowed():
    r, w = os.pipe()
    try:
        assert grow_pipe(w, 256 << 10) == 256 << 10  # below pipe-max-size: anybody gets it
        assert PipeWriter(w, size=128 << 10).size == 128 << 10
    finally:
        os.close(r)
        os.close(w)
    # Without CAP_SYS_RESOURCE (as in most containers, even for root) a size above
    # /proc/sys/fs/pipe-max-size is refused: the pipe gets that maximum instead.
    most = int(Path("/proc/sys/fs/pipe-max-size").read_text())
    code = (
        "import os; from jupyterhub_gpusnap.checkpoint.streamer import grow_pipe; "
        f"r, w = os.pipe(); print(grow_pipe(w, {most * 4}))"
    )
    out = subprocess.run(
        ["setpriv", "--inh-caps=-sys_resource", "--bounding-set=-sys_resource", sys.executable, "-c", code],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert int(out) == most


def criu_like_client(folder):
    """Connect to a streamer as CRIU does; ``ask(name)`` -> exists?, ``read()`` -> the file."""
    from jupyterhub_gpusnap.checkpoint.streamer import SOCKET_NAME

    c = socket.socket(socket.AF_UNIX)
    c.connect(str(folder / SOCKET_NAME))

    def ask(name: str) -> bool:
        req = b"\x0a" + bytes([len(name)]) + name.encode()
        c.sendall(_LEN.pack(len(req)) + req)
        head = c.recv(4)
        body = c.recv(_LEN.unpack(head)[0])
        return body == b"\x08\x01"

    def read(delay: float = 0.0) -> bytes:
        r, w = os.pipe()
        socket.send_fds(c, [b"\0"], [w])
        os.close(w)
        time.sleep(delay)
        data = b""
        while part := os.read(r, 1 << 20):
            data += part
        os.close(r)
        return data

    return c, ask, read


@pytest.fixture
def packed_store(tmp_path):
    """A plain store holding ``pages-1.img`` (1 MiB of random bytes: raw chunks, 64 KiB)
    and ``pages-2.img`` (compressible: zstd chunks); yields (store, chunks, sources)."""
    from concurrent.futures import ThreadPoolExecutor

    from jupyterhub_gpusnap.checkpoint.chunks import ChunkStore

    with ThreadPoolExecutor(2) as pool:
        store = ChunkStore(tmp_path / "store", pool, avg_pages=16)
        srcs = {"pages-1.img": os.urandom(1 << 20), "pages-2.img": bytes(range(256)) * 4096}
        for name, data in srcs.items():
            (tmp_path / name).write_bytes(data)
        packed = store.pack([tmp_path / n for n in srcs])
        yield store, {n: p.chunks for n, p in packed.items()}, srcs


def test_a_streamer_socket_speaks_criu_framing(tmp_path, packed_store):
    """A client doing what CRIU does gets each file's bytes: raw chunks spliced from the
    store's files, compressed ones decompressed and lent to the pipe."""
    from jupyterhub_gpusnap.checkpoint.streamer import ChunkStreamer

    store, chunks, srcs = packed_store
    assert len(chunks["pages-1.img"]) > 1
    assert store.open_raw("plain", *chunks["pages-1.img"][0]) is not None  # really raw
    assert store.open_raw("plain", *chunks["pages-2.img"][0]) is None  # really compressed
    folder = tmp_path / "s"
    folder.mkdir()
    streamer = ChunkStreamer(
        store, "plain", chunks, folder, window=2, prefetch=4, pipe_bytes=64 << 10
    ).start()
    c, ask, read = criu_like_client(folder)
    assert ask("ids-7.img") is False  # absent: CRIU treats it as empty
    assert ask("pages-1.img") is True
    # a slow reader: the 64 KiB pipe fills and the sender waits for it
    assert read(delay=0.5) == srcs["pages-1.img"]
    assert ask("pages-2.img") is True
    assert read() == srcs["pages-2.img"]
    c.close()
    assert streamer.finish() == []
    assert streamer.served == {n: len(d) for n, d in srcs.items()}
    assert streamer.pipe_got == 64 << 10
    assert streamer.waited["criu_s"] > 0.25  # the wait is put on the reader, not the store
    assert streamer.waited["storage_s"] < streamer.waited["criu_s"]


def test_a_damaged_raw_chunk_ends_its_file_before_its_bytes(tmp_path, packed_store):
    from jupyterhub_gpusnap.checkpoint.streamer import ChunkStreamer

    store, chunks, srcs = packed_store
    refs = chunks["pages-1.img"]
    cid, _ = refs[2]
    blob = store.path("plain", cid)
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0x40
    blob.write_bytes(bytes(data))
    folder = tmp_path / "s"
    folder.mkdir()
    streamer = ChunkStreamer(store, "plain", chunks, folder, window=2, prefetch=4).start()
    c, ask, read = criu_like_client(folder)
    assert ask("pages-1.img") is True
    got = read()
    c.close()
    (problem,) = streamer.finish()
    assert cid[:12] in problem and "checksum" in problem
    before = sum(n for _, n in refs[:2])
    assert got == srcs["pages-1.img"][:before]  # every byte up to the damaged chunk, none of it
