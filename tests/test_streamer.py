"""The image streamer's parts: CRIU's request/reply framing and the pipe writer that splices
file pages into the pipe. The whole path with real CRIU is in test_local_chunks.py and
test_restore_e2e.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
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


def test_spliced_pages_outlive_the_files_they_came_from(tmp_path):
    """Ranges of memory files and of a disk file spliced into a pipe reach the reader intact
    although every file was closed (a memory file is gone with its last descriptor; the
    disk file was removed) before the reader took anything: the pipe holds the pages."""
    parts = [os.urandom(n) for n in (4096, 300_000, 7, 500_000)]
    r, w = os.pipe()
    pipe = PipeWriter(w, size=1 << 20)  # holds all of it: nothing is read until the end
    assert pipe.size == 1 << 20
    for i, data in enumerate(parts[:-1]):
        mfd = os.memfd_create(f"part-{i}")
        os.write(mfd, b"head" + data)
        assert pipe.splice_from(mfd, 4, len(data)) is True  # closes mfd
        with pytest.raises(OSError):
            os.fstat(mfd)
    disk = tmp_path / "chunk"
    disk.write_bytes(b"head" + parts[-1])
    assert pipe.splice_from(os.open(disk, os.O_RDONLY), 4, len(parts[-1])) is True
    disk.unlink()
    pipe.close()
    got = b""
    while part := os.read(r, 1 << 20):
        got += part
    os.close(r)
    assert got == b"".join(parts)


def test_a_file_ending_early_or_a_reader_gone_ends_the_splice(tmp_path):
    src = tmp_path / "f"
    src.write_bytes(b"a" * 1000)
    r, w = os.pipe()
    pipe = PipeWriter(w)
    assert pipe.splice_from(os.open(src, os.O_RDONLY), 0, 2000) is None  # 1000 bytes short
    assert os.read(r, 4096) == b"a" * 1000
    os.close(r)
    assert pipe.splice_from(os.open(src, os.O_RDONLY), 0, 1000) is False  # nobody reads
    pipe.close()


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
    store's files, compressed ones from the memory files they were decoded into."""
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


def test_chunks_held_open_stay_within_the_descriptor_limit(tmp_path):
    """Decoded and raw chunks wait for the pipe as open files: with a window far larger than
    the process may open (RLIMIT_NOFILE 64, as low as a limit gets) and two files streamed
    at once, every byte still arrives and nothing is reported."""
    code = r"""
import os, resource, socket, sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from jupyterhub_gpusnap.checkpoint.chunks import ChunkStore
from jupyterhub_gpusnap.checkpoint.streamer import _LEN, SOCKET_NAME, ChunkStreamer

root = Path(sys.argv[1])
pool = ThreadPoolExecutor(4)
store = ChunkStore(root / "store", pool, avg_pages=16)
weights = bytearray(os.urandom(4 << 20))
weights[1::2] = b"<" * (2 << 20)  # like bf16 weights: zstd shrinks it
srcs = {"pages-1.img": os.urandom(4 << 20), "pages-2.img": bytes(weights)}
for name, data in srcs.items():
    (root / name).write_bytes(data)
chunks = {n: p.chunks for n, p in store.pack([root / n for n in srcs]).items()}
assert all(len(c) > 40 for c in chunks.values()), {n: len(c) for n, c in chunks.items()}
assert store.open_raw("plain", *chunks["pages-2.img"][0]) is None  # compressed: memfd
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
folder = root / "s"
folder.mkdir()
streamer = ChunkStreamer(store, "plain", chunks, folder, window=512, prefetch=512).start()
c = socket.socket(socket.AF_UNIX)
c.connect(str(folder / SOCKET_NAME))
ends = {}
for name in srcs:  # both files asked for before either is read: both windows fill
    req = b"\x0a" + bytes([len(name)]) + name.encode()
    c.sendall(_LEN.pack(len(req)) + req)
    c.recv(4 + 2)
    r, w = os.pipe()
    socket.send_fds(c, [b"\0"], [w])
    os.close(w)
    ends[name] = r
import time; time.sleep(1)
for name, r in ends.items():
    data = b""
    while part := os.read(r, 1 << 20):
        data += part
    os.close(r)
    assert data == srcs[name], (name, len(data))
c.close()
print(streamer.finish())
"""
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"
