"""Feed ``criu restore --stream`` from the chunk store while the chunks are read.

A checkpoint kept as chunks would otherwise be unpacked whole before CRIU starts, and
CRIU would then read it a second time: the restore costs the sum of the two. With
``--stream`` CRIU asks an *image streamer* for each image file instead of opening it,
and reads it from a pipe front to back, so the chunks can be read, checked and
decompressed (in the store's thread pool, a window ahead) while CRIU already restores
the memory they hold. Decompressed chunks are lent to the pipe (``vmsplice``); chunks
stored as they are (incompressible data) are spliced from the page cache once checked
(:meth:`ChunkStore.open_raw`), so CRIU reads them as it would read a raw image file.

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
import ctypes
import errno
import fcntl
import os
import select
import socket
import struct
import termios
import threading
import time
from pathlib import Path

from .chunks import ChunkStore

SOCKET_NAME = "streamer-serve.sock"
F_SETPIPE_SZ, F_GETPIPE_SZ = 1031, 1032
PIPE_BYTES = 16 << 20  # what LocalBackend.restore_pipe_bytes asks for by default
_LEN = struct.Struct("<I")


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def parse_request(msg: bytes) -> str:
    """``img_streamer_request_entry``'s ``filename`` (field 1, a string)."""
    i, name = 0, None
    while i < len(msg):
        tag, i = _read_varint(msg, i)
        field, wire = tag >> 3, tag & 7
        if wire == 2:
            n, i = _read_varint(msg, i)
            if field == 1:
                name = msg[i : i + n].decode()
            i += n
        elif wire == 0:
            _, i = _read_varint(msg, i)
        else:
            raise ValueError(f"unexpected protobuf wire type {wire} in a streamer request")
    if name is None:
        raise ValueError("streamer request without a filename")
    return name


def _read_varint(msg: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if i >= len(msg):
            raise ValueError("truncated varint in a streamer request")
        b = msg[i]
        i += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, i
        shift += 7


def reply(exists: bool) -> bytes:
    """A length-prefixed ``img_streamer_reply_entry`` (field 1, a bool)."""
    body = b"\x08" + _varint(int(exists))
    return _LEN.pack(len(body)) + body


class ChunkStreamer:
    """Serves one checkpoint's image files (``chunks``: ``{name: [[id, length], ...]}``
    sealed in ``space``) to one ``criu restore --stream -D folder``.

    :meth:`start` before CRIU starts, :meth:`finish` once it ended (or failed): it waits
    for the files being sent and returns what was wrong with them (empty: every byte CRIU
    got was checked). ``window`` chunks per file are decoded ahead in the store's pool,
    and the disk is asked for ``prefetch`` chunks ahead (:meth:`ChunkStore.prefetch`).
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
                # a chunk stored as it is goes from the page cache into the pipe (splice);
                # the others are decompressed (and decrypted) into memory first
                return self.store.open_raw(self.space, cid, length) or self.store.get(
                    self.space, cid, length
                )

            for cid, _ in refs[: self.prefetch]:
                prefetch(self.space, cid)

            def refill() -> None:
                nonlocal nxt
                while len(ahead) < self.window and nxt < len(refs):
                    cid, length = refs[nxt]
                    ahead.append((cid, pool.submit(load, cid, length)))
                    if nxt + self.prefetch < len(refs):
                        prefetch(self.space, refs[nxt + self.prefetch][0])
                    nxt += 1

            refill()
            while ahead:
                cid, fut = ahead.popleft()
                refill()
                t0 = clock()
                try:
                    data = fut.result()
                except (OSError, ValueError) as e:
                    self._problem(f"{name}: {e}")
                    return
                t1 = clock()
                if isinstance(data, tuple):  # (fd, offset) of a checked raw chunk file
                    ok = pipe.splice_from(*data, length=refs_len[cid])
                else:
                    ok = pipe.write(data)
                storage_s, criu_s = storage_s + t1 - t0, criu_s + clock() - t1
                if ok is None:
                    self._problem(f"{name}: chunk {cid[:12]}… ended early (damaged)")
                    return
                if not ok or self._stop.is_set():
                    return
                sent += refs_len[cid]
        finally:
            for _, fut in ahead:  # chunks loaded for nothing: close the files opened for them
                fut.add_done_callback(_close_opened)
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


def _close_opened(fut) -> None:
    if not fut.cancelled() and fut.exception() is None and isinstance(fut.result(), tuple):
        os.close(fut.result()[0])


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p), ("obj", ctypes.py_object), ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p),
    ]  # fmt: skip


def _vmsplice_fn():
    try:
        fn = ctypes.CDLL(None, use_errno=True).vmsplice
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_size_t, ctypes.c_uint]
    fn.restype = ctypes.c_ssize_t
    return fn


_VMSPLICE = _vmsplice_fn()


def _address(data) -> int:
    """The address of a bytes-like object's memory (held while the object lives)."""
    view = _PyBuffer()
    ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(data), ctypes.byref(view), 0)
    try:
        return view.buf
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(view))


class PipeWriter:
    """Writes buffers into a pipe; with ``vmsplice(2)`` the pipe takes references to our
    pages instead of a copy, so CRIU's read is the only copy of the data.

    The pipe then holds our memory itself: each buffer is kept alive until the pipe no
    longer holds any of it (bytes handed over minus the pipe's unread bytes, FIONREAD),
    and :meth:`close` waits until the reader has taken everything or is gone. Without
    vmsplice (or ``splice = False``) it is a plain ``write``.
    """

    def __init__(self, fd: int, splice: bool = True, size: int = PIPE_BYTES):
        self.fd = fd
        self.splice = splice and _VMSPLICE is not None
        self.handed = 0
        self.held: collections.deque = collections.deque()  # (end offset, buffer)
        self.size = grow_pipe(fd, size)

    def write(self, data) -> bool:
        """Hand over all of ``data``; False when the reader has closed its end."""
        view = memoryview(data).cast("B")
        if not self.splice:
            while view:
                try:
                    view = view[os.write(self.fd, view) :]
                except BrokenPipeError:
                    return False
            return True
        addr, n, off = _address(view), len(view), 0
        self.held.append((self.handed + n, data))
        while off < n:
            iov = _Iovec(addr + off, n - off)
            done = _VMSPLICE(self.fd, ctypes.byref(iov), 1, 0)
            if done < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                if err == errno.EPIPE:
                    return False
                raise OSError(err, os.strerror(err))
            off += done
        self.handed += n
        self._release(self._unread())
        return True

    def splice_from(self, src: int, offset: int, length: int) -> bool | None:
        """Hand over ``length`` bytes of file ``src`` from ``offset`` with ``splice(2)``
        (references to its cached pages, no copy) and close ``src``; False when the reader
        has closed its end, None when the file ended early."""
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
                self.handed += n
            return True
        finally:
            os.close(src)

    def _unread(self) -> int:
        return struct.unpack("i", fcntl.ioctl(self.fd, termios.FIONREAD, b"\0\0\0\0"))[0]

    def _release(self, unread: int) -> None:
        consumed = self.handed - unread
        while self.held and self.held[0][0] <= consumed:
            self.held.popleft()

    def close(self) -> None:
        """Wait until the reader took what the pipe holds of our memory (or closed its
        end), then close the write end."""
        try:
            poller = select.poll()
            poller.register(self.fd, select.POLLOUT)
            while self.held:
                unread = self._unread()
                self._release(unread)
                if not unread:
                    break
                if any(ev & select.POLLERR for _, ev in poller.poll(5)):
                    break  # no reader left: nobody will see the pipe's contents
        finally:
            os.close(self.fd)
            self.held.clear()


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
