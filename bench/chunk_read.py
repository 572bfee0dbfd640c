"""How fast chunk storage can feed a restore, without CRIU: where a streamed restore's time goes.

A file of GIB GiB (bf16 weights as in bench/mem_holder.py, or random bytes) is packed into a
``ChunkStore`` as a checkpoint's ``pages-1.img`` would be; then, with the page cache dropped
before each (root only; ``cold`` says whether it was):

- ``decode in order``: every chunk read, checked and decompressed in the store's thread pool,
  in file order with a window ahead — the work a streamed restore must do;
- ``stream``: the same through ``ChunkStreamer`` over its socket and a pipe, read by this
  process as CRIU would read it (``read()`` into one buffer) — what CRIU could at best get;
- ``unpack``: ``ChunkStore.unpack`` of the whole file to /dev/shm (any order) — the older
  restore's first half;
- ``stream`` once more with the chunks left in the page cache (``cold`` false): what the
  streamer delivers when the disk is out of the way.

Usage: ``python bench/chunk_read.py [--gib 4] [--kind weights|random] [--dir DIR]`` →
bench/results/chunk_read.json.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import print_table, write_json
from mem_holder import seeded_bytes, weights

from jupyterhub_gpusnap.checkpoint import streamer as S
from jupyterhub_gpusnap.checkpoint.chunks import ChunkStore

NAME = "pages-1.img"


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def decode_in_order(store: ChunkStore, refs: list, window: int) -> int:
    ahead: collections.deque = collections.deque()
    i = n = 0
    while i < len(refs) or ahead:
        while len(ahead) < window and i < len(refs):
            if i + 4 * window < len(refs):
                store.prefetch("plain", refs[i + 4 * window][0])
            ahead.append(store.pool.submit(store.get, "plain", refs[i][0], refs[i][1]))
            i += 1
        n += len(ahead.popleft().result())
    return n


def stream(store: ChunkStore, chunks: dict, size: int, window: int) -> int:
    folder = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        streamer = S.ChunkStreamer(
            store, "plain", chunks, folder, window=window, prefetch=4 * window
        ).start()
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(str(folder / S.SOCKET_NAME))
        req = b"\x0a" + bytes([len(NAME)]) + NAME.encode()
        conn.sendall(S._LEN.pack(len(req)) + req)
        head = conn.recv(4)
        conn.recv(S._LEN.unpack(head)[0])
        r, w = os.pipe()
        socket.send_fds(conn, [b"\0"], [w])
        os.close(w)
        buf = memoryview(bytearray(size))
        n = 0
        while n < size and (k := os.readv(r, [buf[n : n + (8 << 20)]])):
            n += k
        os.close(r)
        conn.close()
        problems = streamer.finish()
        if problems:
            sys.exit(f"streamer problems: {problems}")
        return n
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(gib: float, kind: str, root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    threads = os.cpu_count() or 1
    pool = ThreadPoolExecutor(threads)
    store = ChunkStore(root / "store", pool)
    n = int(gib * 2**30)
    data, how = weights(n, 1) if kind == "weights" else (seeded_bytes(n, 1), "random bytes")
    src = root / NAME
    src.write_bytes(data)
    del data
    t = time.perf_counter()
    chunks = {k: p.chunks for k, p in store.pack([src]).items()}
    print(f"packed {gib:g} GiB of {how} in {time.perf_counter() - t:.2f} s", flush=True)
    size = src.stat().st_size
    src.unlink()
    refs = chunks[NAME]
    rows = []

    def measure(what: str, fn, window: int | None = None, warm: bool = False) -> None:
        cold = False if warm else drop_caches()
        t = time.perf_counter()
        got = fn()
        dt = time.perf_counter() - t
        row = {"what": what, "window": window, "cold": cold, "bytes": got, "seconds": round(dt, 3),
               "GBps": round(got / dt / 1e9, 2)}  # fmt: skip
        rows.append(row)
        print(row, flush=True)

    def unpack() -> int:
        out = Path(tempfile.mkdtemp(dir="/dev/shm"))
        try:
            problems = store.unpack("plain", chunks, {NAME: size}, out)
            if problems:
                sys.exit(f"unpack problems: {problems}")
            return size
        finally:
            shutil.rmtree(out, ignore_errors=True)

    for window in (2 * threads, 4 * threads):
        measure("decode in order", lambda w=window: decode_in_order(store, refs, w), window)
        measure("stream", lambda w=window: stream(store, chunks, size, w), window)
    measure("unpack", unpack)
    measure("stream", lambda: stream(store, chunks, size, 4 * threads), 4 * threads, warm=True)
    table = print_table(rows, ["what", "window", "cold", "bytes", "seconds", "GBps"])
    write_json(
        "chunk_read", rows, data=how, gib=gib, threads=threads, chunks=len(refs), table=table
    )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=4)
    p.add_argument("--kind", choices=["weights", "random"], default="weights")
    p.add_argument("--dir", default="/var/tmp/gpusnap-chunk-read")
    a = p.parse_args()
    main(a.gib, a.kind, Path(a.dir))
