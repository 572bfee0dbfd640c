"""Lazy restore against today's eager restore: when the process answers, when all of it is back.

For each size (GiB) a process holding that much random data in host memory and a TCP
listener (in its own PID namespace, as servers run) is checkpointed by ``LocalBackend``,
once stored as ``files`` and once as ``chunks``, and each checkpoint is restored in turns:

- ``eager``: ``LocalBackend.restore`` as today (files: CRIU reads the image, checksums
  after; chunks: streamed to CRIU from the chunk store, every chunk checked);
- ``lazy``: :func:`jupyterhub_gpusnap.checkpoint.lazy.restore` — the tree first, its
  memory from our page server (files: checked against the page sums; chunks: straight
  from the chunk store), fetched on demand and in the background.

``answer_s``: from the restore call to the process's first answer on its port (a request
that touches none of its data: what "my kernel answers" costs). ``all_in_s``: until every
page is back (eager: the restore call; lazy: :attr:`LazyRestore.done`). ``intact``: the
process's own sha256 of its data afterwards equals the one it took before the dump. The
image is dropped from the page cache before each restore (the disk is read).
``sums_s``: writing the page sums of a ``files`` checkpoint right after it was taken
(:func:`~jupyterhub_gpusnap.checkpoint.page_sums.write_sums`, which checks the manifest's
checksums in the same pass), next to ``suspend_s``, the checkpoint call itself.
``served_mib`` / ``requests`` / ``fault_requests``: what the page server sent, in how
many requests, and how many of its requests were for one page (page faults, and
one-page ranges of the daemon's background transfer; the rest is background transfer).
``--copiers N [N ...]``: lazy restores with each number of the daemon's copier threads
(``LocalBackend.lazy_copiers``, CRIU patch 0011; 0: none), in turns with the eager one; one
lazy row per number (default: CRIU's default). ``--shared MIB [MIB ...]``: lazy restores
with the pages going through that much memory shared with the daemon instead of the socket
(``LocalBackend.lazy_shared_mib``, CRIU patch 0012; 0: the socket), for each copier setting.
Where a lazy restore's time went (medians): ``staged_s`` (the small files and the eager pages
staged and checked), ``running_s`` (until the tree runs: staging and CRIU's restore of the
tree), and the page server's waits while the memory came: ``read_wait_s`` (an answer was
asked for and still being read and checked), ``send_wait_s`` (the daemon had not taken the
last answer: it was copying), ``idle_wait_s`` (nothing was asked for). ``--logs DIR`` keeps
the daemon's log and the page server's of the last lazy restore of each storage and copier
setting (``python bench/lazy_pages_log.py DIR/*lazy-pages.log`` reads them, each with the
page server's beside it).
``--repeated F``: the last part F of the data is one byte over and over, like the zero-filled
buffers of a GPU process; the chunk store cuts it into its smallest chunks. ``--zeros F``: the
part F before it is zero bytes (written, so its pages are in the image), which a lazy restore
maps as zero pages without asking for them with CRIU patch 0015 (``zero_pages_mib``: from files
the page sums' zero blocks, from chunks the chunks whose id is that of zero bytes) and otherwise
serves without reading (``zero_mib``: how much of the segments or chunks read was zero).

Usage: ``python bench/lazy_restore.py [--gib 0.2 1 2] [--restores N] [--warm] [--repeated F] [--zeros F]
[--copiers N ...] [--shared MIB ...] [--logs DIR] [--name NAME]``
→ bench/results/lazy_restore.json (or NAME.json; ``--warm``: the image is left in the page
cache, which separates reading the disk from the rest). Needs root, CRIU >= 4.2 and
userfaultfd (``criu check --feature uffd-noncoop``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import print_table, write_json

from jupyterhub_gpusnap import sandbox
from jupyterhub_gpusnap.checkpoint import criu, lazy
from jupyterhub_gpusnap.checkpoint.local import LocalBackend
from jupyterhub_gpusnap.checkpoint.manifest import Manifest, drop_cached, is_pages_file
from jupyterhub_gpusnap.checkpoint.page_sums import write_sums
from jupyterhub_gpusnap.model import Server

COLUMNS = [
    "gib", "storage", "mode", "copiers", "shared_mib", "answer_s", "answer_min_s", "answer_max_s", "all_in_s",
    "all_in_ratio", "intact", "suspend_s", "sums_s", "served_mib", "requests", "fault_requests",
    "zero_mib", "zero_pages_mib", "staged_s", "running_s", "read_wait_s", "send_wait_s", "idle_wait_s", "put_s",
    "background_answer_p50_ms",
]  # fmt: skip

HOLDER = r"""
import hashlib, json, os, socket, sys
port, n = int(sys.argv[1]), int(float(sys.argv[2]) * (1 << 30))
same = int(n * float(sys.argv[3]))  # the last part: one byte over and over
zeros = int(n * float(sys.argv[4]))  # the part before it: zero bytes (written: in the image)
data = bytearray(n)
for i in range(0, n, 64 << 20):
    k = min(64 << 20, n - i)
    if i >= n - same:
        data[i : i + k] = b"\1" * k
    elif i >= n - same - zeros:
        data[i : i + k] = bytes(k)
    else:
        data[i : i + k] = os.urandom(k)
digest = hashlib.sha256(data).hexdigest()
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port))
s.listen(8)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    cmd = c.recv(100).decode().strip()
    reply = {"digest": digest}
    if cmd == "hash":
        reply["now"] = hashlib.sha256(data).hexdigest()
    c.sendall(json.dumps(reply).encode())
    c.close()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def ask(port: int, cmd: str = "get", timeout: float = 600) -> dict:
    async def go():
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(cmd.encode())
        await w.drain()
        data = await r.read()
        w.close()
        return json.loads(data)

    return await asyncio.wait_for(go(), timeout)


async def answer(port: int, timeout: float = 600) -> dict:
    """The first answer on ``port`` (connecting again until the listener is back)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await ask(port)
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.002)


class Holder:
    """The process: ``unshare --pid --fork`` → the holder (its namespace's init)."""

    def __init__(self, gib: float, repeated: float = 0.0, zeros: float = 0.0):
        self.port = free_port()
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "setsid", sys.executable, "-c", HOLDER,
             str(self.port), str(gib), str(repeated), str(zeros)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        import psutil

        deadline = time.monotonic() + 600
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"holder did not start (exit {self.proc.poll()})") from None
                time.sleep(0.1)
        self.pid = psutil.Process(self.proc.pid).children()[0].pid


def kill_tree(pid: int) -> None:
    """Kill a namespace's init (the kernel ends the rest); wait until it is gone."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def drop(backend: LocalBackend, folder: Path, m: Manifest) -> None:
    if m.storage == "chunks":
        backend.chunk_store().drop_cached(m.key_id, m.chunks)
    else:
        drop_cached(folder)


async def restore_eager(backend: LocalBackend, info, port: int) -> dict:
    t = time.monotonic()
    pid = (await backend.restore(info)).pid
    all_in = time.monotonic() - t
    await answer(port)
    answered = time.monotonic() - t
    now = (await ask(port, "hash"))["now"]
    restored = backend.restored.get(pid)
    kill_tree(pid)
    if restored is not None:
        await asyncio.to_thread(restored.criu.wait)
    return {"answer_s": answered, "all_in_s": all_in, "now": now}


async def restore_lazy(
    backend: LocalBackend, folder: Path, m: Manifest, port: int, pool, copiers: int | None,
    shared_mib: int = 0,
) -> dict:  # fmt: skip
    if m.storage == "chunks":
        image = lazy.ChunksImage(backend.chunk_store(), m.key_id, m.chunks, m.sizes)
    else:
        image = lazy.FilesImage(folder, m.files, m.sizes, m.chunk_bytes)
    staging = Path(tempfile.mkdtemp(prefix="gpusnap-lazy-", dir="/dev/shm"))
    try:
        t = time.monotonic()
        lr = await lazy.restore(
            image, staging, staging / "restore.pid", pool=pool, tcp=m.tcp_mode,
            shell_job=m.shell_job,
            extra=sandbox.restore_args(bool(m.extra.get("mount_namespace"))), copiers=copiers,
            shared_bytes=shared_mib << 20,
        )  # fmt: skip
        if shared_mib and not lr.stats["shared_bytes"]:
            raise SystemExit(f"--shared {shared_mib}: {criu.find_criu()} lacks CRIU patch 0012")
        await answer(port)
        answered = time.monotonic() - t
        stats = await lr.done
        all_in = time.monotonic() - t
        now = (await ask(port, "hash"))["now"]
        kill_tree(lr.pid)
        await asyncio.to_thread(lr.restored.criu.wait)
        if LOGS is not None:  # the daemon's log of the last lazy restore of each kind
            LOGS.mkdir(parents=True, exist_ok=True)
            name = f"{m.storage}_{copiers if copiers is not None else 'default'}_{shared_mib}"
            for log in (lazy.LAZY_LOG, lazy.PAGE_SERVER_LOG):  # the daemon's, the page server's
                shutil.copyfile(staging / log, LOGS / f"{name}_{log}")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"answer_s": answered, "all_in_s": all_in, "now": now,
            "served_mib": round(stats["served_bytes"] / 2**20, 1),
            "requests": stats["requests"], "fault_requests": stats["fault_requests"],
            "zero_mib": round(stats.get("zero_bytes", 0) / 2**20, 1),
            "zero_pages_mib": round(stats.get("zero_pages_bytes", 0) / 2**20, 1),
            # where the time went: staging, the tree's restore, then the page server's
            # waits while the memory came (read: reading and checking; send: the daemon had
            # not taken the last answer; idle: nothing asked for)
            **{k: stats.get(k) for k in PHASES}}  # fmt: skip


async def run(sizes: list[float], restores: int, root: Path) -> list[dict]:
    pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 2)
    rows = []
    for gib in sizes:
        for storage in ("files", "chunks"):
            backend = LocalBackend(  # its restore() is the eager row: never lazy
                checkpoint_dir=str(root / storage),
                storage=storage,
                min_free_bytes=0,
                restore_mode="eager",
            )
            h = Holder(gib, REPEATED, ZEROS)
            before = (await ask(h.port, "hash"))["digest"]
            t = time.monotonic()
            info = await backend.checkpoint(Server(user="bench", name="", state={"pid": h.pid}))
            suspend_s = time.monotonic() - t
            h.proc.wait(60)
            folder = backend.folder(info.id)
            m = Manifest.load(folder)
            sums_s = None
            if storage == "files":
                t = time.monotonic()
                pages = [n for n in m.files if is_pages_file(n)]
                problems = await asyncio.to_thread(
                    write_sums, folder, pages, pool, expected=m.files, chunk_bytes=m.chunk_bytes
                )
                sums_s = time.monotonic() - t
                assert not problems, problems
            modes = [("eager", None, 0)] + [("lazy", c, sh) for c in COPIERS for sh in SHARED]
            runs: dict[tuple, list[dict]] = {mode: [] for mode in modes}
            for _ in range(restores):
                for mode in modes:  # in turns: a drifting machine slows all
                    m = Manifest.load(folder)
                    m.status = "verified"
                    m.save(folder)
                    if not WARM:
                        await asyncio.to_thread(drop, backend, folder, m)
                    if mode[0] == "eager":
                        got = await restore_eager(backend, info, h.port)
                    else:
                        got = await restore_lazy(backend, folder, m, h.port, pool, *mode[1:])
                    got["intact"] = got.pop("now") == before
                    runs[mode].append(got)
            eager_all_in = statistics.median(r["all_in_s"] for r in runs[("eager", None, 0)])
            for (mode, copiers, shared), got in runs.items():
                answers = [r["answer_s"] for r in got]
                all_in = statistics.median(r["all_in_s"] for r in got)
                rows.append({
                    "gib": gib, "storage": storage, "mode": mode, "copiers": copiers,
                    "shared_mib": shared if mode == "lazy" else None,
                    "answer_s": round(statistics.median(answers), 3),
                    "answer_min_s": round(min(answers), 3),
                    "answer_max_s": round(max(answers), 3),
                    "all_in_s": round(all_in, 3),
                    "all_in_ratio": round(all_in / eager_all_in, 2),
                    "intact": all(r["intact"] for r in got),
                    "suspend_s": round(suspend_s, 3),
                    "sums_s": round(sums_s, 3) if sums_s is not None and mode == "lazy" else None,
                    "served_mib": got[-1].get("served_mib"),
                    "requests": got[-1].get("requests"),
                    "fault_requests": got[-1].get("fault_requests"),
                    "zero_mib": got[-1].get("zero_mib"),
                    "zero_pages_mib": got[-1].get("zero_pages_mib"),
                    **{k: round(statistics.median(r[k] for r in got), 3) if mode == "lazy"
                       else None for k in PHASES},
                })  # fmt: skip
            shutil.rmtree(root / storage, ignore_errors=True)
    pool.shutdown()
    return rows


PHASES = (
    "staged_s", "running_s", "read_wait_s", "send_wait_s", "idle_wait_s", "put_s",
    "background_answer_p50_ms", "background_answer_p90_ms",
)  # fmt: skip
LOGS: Path | None = None  # --logs: where the daemon's logs are kept
SHARED: list = [0]  # --shared: MiB of memory the pages go through instead of the socket
COPIERS: list = [None]  # --copiers: the lazy restores' copier threads (None: CRIU's default)
WARM = False  # --warm: the image stays in the page cache (separates the disk from the rest)
REPEATED = 0.0  # --repeated: the part of the data that is one byte over and over
ZEROS = 0.0  # --zeros: the part of the data (before the repeated part) that is zero bytes


def main() -> None:
    global WARM, REPEATED, COPIERS, LOGS, SHARED, ZEROS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[0.2, 1, 2])
    ap.add_argument("--restores", type=int, default=1)
    ap.add_argument("--dir", default="", help="where checkpoints go (default: a temporary folder)")
    ap.add_argument("--name", default="lazy_restore")
    ap.add_argument("--warm", action="store_true", help="leave the image in the page cache")
    ap.add_argument("--repeated", type=float, default=0.0,
                    help="the part of the data (0-1) that is one byte over and over, like the "
                    "zero-filled buffers of a GPU process: it is cut into the smallest chunks")  # fmt: skip
    ap.add_argument("--copiers", type=int, nargs="+", default=[None],
                    help="lazy restores with each number of copier threads (0: none)")  # fmt: skip
    ap.add_argument("--logs", default="", help="keep the daemon's logs in this folder")
    ap.add_argument("--shared", type=int, nargs="+", default=[0],
                    help="lazy restores with the pages going through this many MiB of shared "
                    "memory (0: the socket; CRIU patch 0012)")  # fmt: skip
    ap.add_argument("--zeros", type=float, default=0.0,
                    help="the part of the data (0-1, before the --repeated part) that is zero "
                    "bytes, like a GPU process's zero-filled buffers: a lazy restore maps it as "
                    "zero pages (CRIU patch 0015) or serves it without reading it")  # fmt: skip
    args = ap.parse_args()
    SHARED, ZEROS = args.shared, args.zeros
    WARM, REPEATED, COPIERS = args.warm, args.repeated, args.copiers
    LOGS = Path(args.logs) if args.logs else None
    root = Path(args.dir or tempfile.mkdtemp(prefix="gpusnap-bench-lazy-", dir="/var/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        rows = asyncio.run(run(args.gib, args.restores, root))
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    table = print_table(rows, COLUMNS)
    write_json(args.name, rows, restores=args.restores, warm=WARM, repeated=REPEATED,
               copiers=COPIERS, shared=SHARED, zeros=ZEROS, table=table)  # fmt: skip


if __name__ == "__main__":
    main()
