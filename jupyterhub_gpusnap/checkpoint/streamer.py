"""Feed ``criu restore --stream`` from the chunk store while the chunks are read.

A checkpoint kept as chunks would otherwise be unpacked whole before CRIU starts, and
CRIU would then read it a second time: the restore costs the sum of the two. With
``--stream`` CRIU asks an *image streamer* for each image file instead of opening it,
and reads it from a pipe front to back, so the chunks can be read, checked and
decompressed (in the store's thread pool, a window ahead) while CRIU already restores
the memory they hold. Every chunk reaches the pipe as page-cache pages, spliced once it
is checked (:meth:`ChunkStore.open_chunk`): a chunk stored as it is (incompressible data)
from its own file, any other from the memory file it was decoded into. CRIU copies such
pages out of a pipe as fast as from a raw image file; anonymous memory lent to the pipe
(``vmsplice``, the first design) took it 1.5x as long (docs/performance.md).

The protocol (CRIU 4.x, ``criu/img-streamer.c``): CRIU connects once to
``<images-dir>/streamer-serve.sock``. For each file it sends a request (a
little-endian ``u32`` length, then the protobuf ``img_streamer_request_entry
{filename = 1}``); the streamer answers ``img_streamer_reply_entry {exists = 1}`` the
same way; for a file that exists CRIU then passes the write end of a new pipe
(``SCM_RIGHTS``, one dummy byte) and reads the file from the read end.

Every chunk is checked against its id before its bytes enter the pipe. A damaged or
missing chunk closes that file's pipe early: CRIU fails on the short read and ends the
tree it was building. A short file that happens to end where a whole record ends could
look complete to CRIU, so :meth:`ChunkStreamer.finish` returns the problems and the
caller must not hand out a tree restored while any were found.
"""

from __future__ import annotations

import collections
import fcntl
import os
import resource
import socket
import struct
import threading
import time
from pathlib import Path

from .chunks import ChunkStore
from .protobuf import fields, varint

SOCKET_NAME = "streamer-serve.sock"
F_SETPIPE_SZ, F_GETPIPE_SZ = 1031, 1032
PIPE_BYTES = 16 << 20  # what LocalBackend.restore_pipe_bytes asks for by default
_LEN = struct.Struct("<I")


def parse_request(msg: bytes) -> str:
    """``img_streamer_request_entry``'s ``filename`` (field 1, a string)."""
    names = [v for n, v in fields(msg) if n == 1 and isinstance(v, bytes)]
    if not names:
        raise ValueError("streamer request without a filename")
    return names[-1].decode()


def reply(exists: bool) -> bytes:
    """A length-prefixed ``img_streamer_reply_entry`` (field 1, a bool)."""
    body = b"\x08" + varint(int(exists))
    return _LEN.pack(len(body)) + body


class ChunkStreamer:
    """Serves one checkpoint's image files (``chunks``: ``{name: [[id, length], ...]}``
    sealed in ``space``) to one ``criu restore --stream -D folder``.

    :meth:`start` before CRIU starts, :meth:`finish` once it ended (or failed): it waits
    for the files being sent and returns what was wrong with them (empty: every byte CRIU
    got was checked). ``window`` chunks per file are decoded ahead in the store's pool,
    and the disk is asked for ``prefetch`` chunks ahead (:meth:`ChunkStore.prefetch`).
    A chunk waits for the pipe as an open file: all files together hold at most
    :func:`open_chunk_limit` of them (a window of 4 per CPU on a big node, times the
    processes of a tree, would pass a 1024-descriptor limit).
    """

    def __init__(self, store: ChunkStore, space: str, chunks: dict[str, list], folder: Path,
                 window: int = 16, prefetch: int = 64, pipe_bytes: int = PIPE_BYTES):  # fmt: skip
        self.store = store
        self.space = space
        self.chunks = chunks
        self.folder = Path(folder)
        self.window = max(1, window)
        self.prefetch = max(self.window, prefetch)
        self.pipe_bytes = pipe_bytes  # asked for
        self.pipe_got = 0  # the largest pipe CRIU's files actually came through
        # seconds the senders waited, summed over files: for the store's next chunk (reading,
        # checking, decompressing is the bound) and for room in the pipe (CRIU is)
        self.waited = {"storage_s": 0.0, "criu_s": 0.0}
        self.problems: list[str] = []
        self.served: dict[str, int] = {}  # name -> bytes sent
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        # every chunk loaded ahead is an open file until it is spliced: all files together
        # stay within the descriptors this process may open (RLIMIT_NOFILE)
        self._open = threading.Semaphore(open_chunk_limit())
        self._listener: socket.socket | None = None
        self._conn: socket.socket | None = None

    @property
    def path(self) -> Path:
        return self.folder / SOCKET_NAME

    def start(self) -> ChunkStreamer:
        self.path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        os.chmod(self.path, 0o600)
        listener.listen(1)
        self._listener = listener
        t = threading.Thread(target=self._serve, name="gpusnap-streamer", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def _problem(self, text: str) -> None:
        with self._lock:
            self.problems.append(text)

    def _serve(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return  # closed before CRIU connected (it failed first)
        self._conn = conn
        with conn:
            while not self._stop.is_set():
                try:
                    head = _recv_exact(conn, _LEN.size)
                    if head is None:
                        return  # CRIU is done with the streamer
                    msg = _recv_exact(conn, _LEN.unpack(head)[0])
                    if msg is None:
                        return
                    name = parse_request(msg)
                    exists = name in self.chunks
                    conn.sendall(reply(exists))
                    if not exists:
                        continue
                    _, fds, _, _ = socket.recv_fds(conn, 1, 1)
                    if not fds:
                        self._problem(f"{name}: CRIU sent no pipe")
                        return
                except (OSError, ValueError) as e:
                    if not self._stop.is_set():
                        self._problem(f"streamer connection: {e}")
                    return
                t = threading.Thread(target=self._send, args=(name, fds[0]), daemon=True,
                                     name=f"gpusnap-streamer-{name}")  # fmt: skip
                t.start()
                self._threads.append(t)

    def _send(self, name: str, fd: int) -> None:
        """Write ``name``'s chunks into ``fd`` in order, ``window`` of them read ahead."""
        sent = 0
        ahead: collections.deque = collections.deque()
        storage_s = criu_s = 0.0
        clock = time.perf_counter
        pipe = PipeWriter(fd, size=self.pipe_bytes)
        with self._lock:
            self.pipe_got = max(self.pipe_got, pipe.size)
        try:
            refs = self.chunks[name]
            refs_len = dict(refs)
            pool, prefetch = self.store.pool, self.store.prefetch
            nxt = 0  # the next chunk to decode

            def load(cid: str, length: int):
                return self.store.open_chunk(self.space, cid, length)

            for cid, _ in refs[: self.prefetch]:
                prefetch(self.space, cid)

            def refill() -> None:
                nonlocal nxt
                while len(ahead) < self.window and nxt < len(refs):
                    # one chunk in flight per file needs no slot: every file moves on
                    if ahead and not self._open.acquire(blocking=False):
                        return
                    cid, length = refs[nxt]
                    ahead.append((cid, pool.submit(load, cid, length), bool(ahead)))
                    if nxt + self.prefetch < len(refs):
                        prefetch(self.space, refs[nxt + self.prefetch][0])
                    nxt += 1

            refill()
            while ahead:
                cid, fut, slot = ahead.popleft()
                t0 = clock()
                try:
                    data = fut.result()  # (fd, offset) holding the checked chunk
                except (OSError, ValueError) as e:
                    self._problem(f"{name}: {e}")
                    return
                finally:
                    if slot:
                        self._open.release()  # the slot passes to the chunk loaded next
                t1 = clock()
                refill()
                t2 = clock()
                ok = pipe.splice_from(*data, length=refs_len[cid])
                storage_s, criu_s = storage_s + t1 - t0, criu_s + clock() - t2
                if ok is None:
                    self._problem(f"{name}: chunk {cid[:12]}… ended early (damaged)")
                    return
                if not ok or self._stop.is_set():
                    return
                sent += refs_len[cid]
        finally:
            for _, fut, slot in ahead:  # loaded for nothing: close the files opened for them
                fut.add_done_callback(self._close_and_free if slot else _close_opened)
            with self._lock:
                self.served[name] = sent
                self.waited["storage_s"] += storage_s
                self.waited["criu_s"] += criu_s
            pipe.close()

    def finish(self, timeout: float = 30.0) -> list[str]:
        """Stop serving, wait for the senders; the problems found (see the module doc)."""
        self._stop.set()
        for s in (self._listener, self._conn):
            if s is not None:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        for t in self._threads:
            t.join(timeout)
        self.path.unlink(missing_ok=True)
        return list(self.problems)

    def _close_and_free(self, fut) -> None:
        _close_opened(fut)
        self._open.release()


def _close_opened(fut) -> None:
    if not fut.cancelled() and fut.exception() is None:
        os.close(fut.result()[0])


def open_chunk_limit() -> int:
    """How many chunks a streamer may hold open at once: half the descriptors this process
    may open (``RLIMIT_NOFILE``'s soft limit; the rest stays for everything else), at
    least 4 — the senders go on one chunk at a time past it."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 16
    return max(4, soft // 2)


class PipeWriter:
    """Splices file ranges into a pipe (``splice(2)``): the pipe takes references to the
    file's pages instead of a copy — a chunk file's cached pages, or the memory file a
    chunk was decoded into (:meth:`ChunkStore.open_chunk`) — so CRIU's read is the only
    copy of the data, and the pages live on in the pipe after the file is closed.
    """

    def __init__(self, fd: int, size: int = PIPE_BYTES):
        self.fd = fd
        self.size = grow_pipe(fd, size)

    def splice_from(self, src: int, offset: int, length: int) -> bool | None:
        """Hand over ``length`` bytes of file ``src`` from ``offset`` and close ``src``;
        False when the reader has closed its end, None when the file ended early."""
        try:
            while length:
                try:
                    n = os.splice(src, self.fd, length, offset_src=offset)
                except BrokenPipeError:
                    return False
                if not n:
                    return None
                offset += n
                length -= n
            return True
        finally:
            os.close(src)

    def close(self) -> None:
        """Close the write end: the reader gets what the pipe holds, then the end."""
        os.close(self.fd)


def grow_pipe(fd: int, size: int) -> int:
    """Make the pipe hold ``size`` bytes, or as much of it as this process may ask for;
    the size it now has.

    CRIU waits whenever the pipe runs empty and the sender whenever it is full; the default
    pipe (64 KiB, or 1 MiB where pipe-max-size allows) makes them take turns every few
    hundred microseconds. Above ``/proc/sys/fs/pipe-max-size`` the kernel wants
    CAP_SYS_RESOURCE, which container runtimes often drop even for root: the sysctl
    ``fs.pipe-max-size`` then decides (see docs/performance.md).
    """
    try:
        fcntl.fcntl(fd, F_SETPIPE_SZ, size)
    except OSError:
        try:
            most = int(Path("/proc/sys/fs/pipe-max-size").read_text())
            fcntl.fcntl(fd, F_SETPIPE_SZ, min(most, size))
        except (OSError, ValueError):
            pass  # the default size works, with more wake-ups
    try:
        return fcntl.fcntl(fd, F_GETPIPE_SZ)
    except OSError:
        return 0


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return bytes(buf)
