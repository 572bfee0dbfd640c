"""A page server for ``criu lazy-pages``: memory pages, checked, on demand.

A lazy restore (:mod:`.lazy`) restores a process tree without its memory; CRIU's
lazy-pages daemon catches each page fault (userfaultfd) and asks a *page server* for
the pages, then copies the rest in the background. CRIU's own page server reads the
image as it is; this one answers from a :mod:`.page_source` that checks every byte
first (a raw pages file against its page sums, or the chunk store against chunk ids),
so a page that fails its check never reaches the process.

The protocol (CRIU 4.x, ``criu/page-xfer.c``, ``criu/uffd.c``), on the socket the
daemon is given with ``--page-server --ps-socket FD``: each request is a ``struct
page_server_iov {u32 cmd; u64 nr_pages; u64 vaddr; u64 dst_id}`` (32 bytes, native
alignment, little-endian here). ``PS_IOV_GET`` asks for ``nr_pages`` pages from
``vaddr`` of process ``dst_id`` (its pid as the image names it); the answer is the same
struct with ``cmd = PS_IOV_ADD_F | PE_PRESENT << 16``, then the pages. A page fault asks
for 64 KiB to 8 MiB from the faulting page, and for the runs of pages after it up to 4 MiB
away (fault-around); the background transfer asks, up to four requests per process at a
time, for the next pages in address order, from 64 KiB up to 16 MiB per request (our CRIU
patches 0002, 0003, 0005). When done, the daemon sends ``PS_IOV_FORCE_CLOSE``
(``PS_IOV_CLOSE`` on its own TCP connection) and waits for an ``int32`` status (0).

Faults first: upstream the daemon matches answers to requests in order, so a fault waited
behind every background answer asked for before it. With our CRIU patch 0004 the daemon
flags a fault's request ``PS_GET_URGENT`` (0005: fault-around ``PS_GET_AROUND``, in the
command's flag bits) and matches each answer to its request by the ``(dst_id, vaddr)`` it
carries. This server reads flagged requests on threads of their own (not behind the
read-ahead) and sends whichever answer is read first, faults before fault-around before the
rest; unflagged requests are answered in request order, as upstream expects, and none
waits for one still being read. A fault's answer that is not in memory yet is read in the
page sums' blocks that hold it (64 KiB), not in whole checked segments (1 MiB): the
faulting thread waits for that read alone.

Every answer is the whole request. (CRIU takes fewer pages than it asked for, puts the rest
back and asks again later; but a thread that faulted on a page of a request in flight waits
for that request and is not woken by the later one: with partial answers a kernel's thread
waited for the background transfer to reach its page, 8 s at 8 GiB.) A request that goes
on in its pages file where the last answer or request of its kind ended (the background
transfer, or faults of a reader going through memory in order) starts checking the next
``ahead`` bytes in the pool; a lone fault does not, nor do the pages around a fault.

Shared memory (CRIU patch 0012): through the socket each page is copied twice more, by
this server into the socket and by the daemon out of it, before the daemon copies it into
the process. Given an :class:`AnswerRing`, a memfd the daemon maps read-only
(``CRIU_LAZY_SHM_FD``), the server puts an answer's pages there and sends only the header,
flagged ``PE_SHM``, and a ``u64``: where in that memory the pages are. Once it has copied
them into the process the daemon gives them back (``PS_IOV_PUT``, the offset as ``vaddr``).
An answer waits for room in the ring (``send`` wait), so the ring bounds what is in flight;
the background transfer may fill half of it at most: the daemon takes answers in the order
they come, and a fault's answer then waits behind no more than that (about 10 ms at 32 MiB),
with room left for it.

On a failed check the server answers nothing more: the faulting thread stays blocked in
the kernel, never running on with memory that is not its own, until :mod:`.lazy` has
killed the tree (:attr:`PageServer.failure` says what failed).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import struct
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor

from .page_source import PageDamaged
from .pagemap import PAGE, Pagemap, PagemapError

IOV = struct.Struct("<I4xQQQ")
PS_IOV_ADD_F = 6
PS_IOV_GET = 7
PS_IOV_CLOSE = 0x1023
PS_IOV_FORCE_CLOSE = 0x1024
PS_IOV_PUT = 0x1030  # the daemon copied an answer out of the shared memory (CRIU patch 0012)
PS_CMD_BITS = 16
PE_PRESENT = 1 << 2
PE_SHM = 1 << 8  # an answer whose pages are in the shared memory (CRIU patch 0012)
SHM_OFFSET = struct.Struct("<Q")
LARGEST_ANSWER = 8 << 20  # the daemon asks for at most this much at a time (a fault's)
SHARED_MIN = 2 * LARGEST_ANSWER  # the background transfer fills half of the ring at most
PS_GET_URGENT = 0x1  # flag of a request a page fault waits for (CRIU patch 0004)
PS_GET_AROUND = 0x2  # flag of a request for the pages around a fault (CRIU patch 0005)
AHEAD = 48 << 20  # bytes checked ahead of a background transfer (3 of its largest requests)
FAULT_THREADS = 2  # threads reading what faults ask for; as many for the pages around them

#: kinds of request, in the order they are answered
FAULT, AROUND, BACKGROUND = 0, 1, 2
CLOSE = object()  # the daemon is done: answer its status (after every answer before it)


class AnswerRing:
    """Memory shared with the daemon (a memfd of ``size`` bytes) that answers' pages go
    into, handed out in order as a ring: the daemon gives each answer back once it has
    copied it, in the order they came."""

    def __init__(self, size: int):
        if size < SHARED_MIN:
            raise ValueError(f"shared memory for answers: {size} bytes, less than twice the "
                             f"largest answer ({SHARED_MIN >> 20} MiB)")  # fmt: skip
        self.size = size
        self.fd = os.memfd_create("gpusnap-lazy-answers", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.mem = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self.mem)
        # (offset, bytes, for the background transfer) out, oldest first
        self.live: deque[tuple[int, int, bool]] = deque()
        self.head = 0  # where the newest ends
        self.closed = False
        self.given = asyncio.Event()

    @property
    def used(self) -> int:
        """Bytes out."""
        return sum(n for _, n, _ in self.live)

    @property
    def background(self) -> int:
        """Bytes out for the background transfer."""
        return sum(n for _, n, bg in self.live if bg)

    def carries(self, n: int) -> bool:
        """Whether an answer of ``n`` bytes goes through the ring (a larger one, which the
        daemon does not ask for, goes by the socket)."""
        return n <= self.size // 2

    def _where(self, n: int, background: bool) -> int | None:
        if background and self.background + n > self.size // 2:
            return None
        if not self.live:
            return 0
        tail = self.live[0][0]
        if self.head > tail:  # in use: [tail, head)
            if n <= self.size - self.head:
                return self.head
            return 0 if n <= tail else None
        return self.head if n <= tail - self.head else None  # in use: [tail, end), [0, head)

    def room(self, n: int, background: bool = False) -> bool:
        """Whether ``n`` bytes fit now; for the background transfer, within half the ring."""
        return self._where(n, background) is not None

    def take(self, n: int, background: bool = False) -> int | None:
        """Where ``n`` bytes go (None: no room now, or closed)."""
        off = None if self.closed else self._where(n, background)
        if off is not None:
            self.live.append((off, n, background))
            self.head = off + n
        return off

    async def wait_given(self) -> None:
        """Until the daemon gives some back (or the ring is closed)."""
        if not self.closed:
            self.given.clear()
            await self.given.wait()

    def put(self, data: list, off: int) -> None:
        for v in data:
            self.view[off : off + len(v)] = v
            off += len(v)

    def give(self, off: int, n: int) -> None:
        """The daemon copied the ``n`` bytes at ``off``: room for others."""
        for out in self.live:
            if out[:2] == (off, n):
                self.live.remove(out)
                self.given.set()
                return
        raise ValueError(f"lazy-pages gave back {n} bytes at {off} of the shared memory, "
                         "which it was not given")  # fmt: skip

    def close(self) -> None:
        self.closed = True
        self.given.set()

    def release(self) -> None:
        self.close()
        self.view.release()
        self.mem.close()
        os.close(self.fd)


def _kind(flags: int) -> int:
    if flags & PS_GET_URGENT:
        return FAULT
    return AROUND if flags & PS_GET_AROUND else BACKGROUND


class PageServer:
    """Serves the pages of ``pagemaps`` from ``sources`` ({pages file name: source}).

    ``pool`` runs the blocking reads and checks of the background transfer (and the
    read-ahead); what a fault asks for, and the pages around it, are read on threads of
    this server's own. ``on_failure(error)`` is called once, in the event loop, when a
    request cannot be answered with checked pages.
    """

    def __init__(
        self,
        pagemaps: list[Pagemap],
        sources: dict,
        pool: Executor,
        *,
        on_failure: Callable[[Exception], None] | None = None,
        ahead: int = AHEAD,
        ring: AnswerRing | None = None,
    ):
        self.maps = {pm.pid: pm for pm in pagemaps if pm.pid is not None}
        self.sources = sources
        self.pool = pool
        self.on_failure = on_failure
        self.ahead = ahead
        self.ring = ring  # answers' pages in memory shared with the daemon (None: the socket)
        self.failure: Exception | None = None
        self.closed = asyncio.Event()  # the daemon said it is done
        self.requests = 0
        self.asked = [0, 0, 0]  # requests by kind: FAULT, AROUND, BACKGROUND
        self.bytes = 0
        self.read_s = 0.0  # thread time spent reading and checking
        # Where the sender's time went (seconds), to tell what holds the transfer back:
        # ``read``: an answer was asked for but not yet read and checked (the disk, the
        # checks); ``send``: an answer was written and the daemon had not taken it yet (it
        # copies the one before into the process); ``idle``: nothing was asked for.
        self.waited = {"read": 0.0, "send": 0.0, "idle": 0.0}
        self.from_memory = 0  # background requests whose answer was checked before they came
        self.put_s = 0.0  # copying answers into the shared memory (part of ``send``)
        # every request: [read at, kind, process, vaddr, pages, answer written at] (wall
        # clock, as CRIU's log: to set beside the daemon's, bench/lazy_pages_log.py)
        self.trace: list[list] = []
        self.first_at: float | None = None
        self.last_at: float | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pools = [
            ThreadPoolExecutor(FAULT_THREADS, thread_name_prefix="gpusnap-fault"),
            ThreadPoolExecutor(FAULT_THREADS, thread_name_prefix="gpusnap-around"),
            pool,
        ]
        # answers to send, by kind (the daemon's status after the background ones)
        self._queues: list[deque] = [deque(), deque(), deque()]
        self._wake = asyncio.Event()
        self._full = False  # a read answer waits for room in the shared memory
        # (pages file, kind) -> the offset after its last answer, and after its last request
        self._next: dict[tuple[str, int], int] = {}
        self._asked: dict[tuple[str, int], int] = {}

    @property
    def background_answer_s(self) -> list[float]:
        """Seconds from each background request's arrival until its answer was written:
        what the daemon's requests in flight must cover."""
        return [w - r for r, kind, *_, w in self.trace if kind == BACKGROUND and w is not None]

    @property
    def faults(self) -> int:
        """Requests made for page faults: a fault's own, and those for the pages around it."""
        return self.asked[FAULT] + self.asked[AROUND]

    # ------------------------------------------------------------ serving
    async def serve(self, sock) -> None:
        """Answer the daemon on ``sock`` (a connected stream socket) until it hangs up."""
        reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 16)
        self._writer = writer
        sender = asyncio.ensure_future(self._send(writer))
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    head = await reader.readexactly(IOV.size)
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                cmd, nr, vaddr, dst = IOV.unpack(head)
                kind = _kind(cmd >> PS_CMD_BITS)
                cmd &= (1 << PS_CMD_BITS) - 1
                if self.failure is not None:
                    continue  # answer nothing more
                if cmd == PS_IOV_GET:
                    self.requests += 1
                    self.asked[kind] += 1
                    if self.first_at is None:
                        self.first_at = time.monotonic()
                    try:
                        source, ranges = self._locate(dst, vaddr, nr)
                    except PageDamaged as e:
                        fut = loop.create_future()  # reported in its turn, by _send
                        fut.set_exception(e)
                    else:
                        in_order = self._in_order(source, ranges, kind)
                        fut = self._cached(source, ranges, in_order)
                        if fut is None:
                            fut = loop.run_in_executor(
                                self._pools[kind], self._read, source, ranges, in_order, kind
                            )
                        elif kind == BACKGROUND:
                            self.from_memory += 1
                    row = [time.time(), kind, dst, vaddr, nr, None]
                    self.trace.append(row)
                    self._queue((vaddr, dst, fut, kind, row), kind)
                elif cmd == PS_IOV_PUT and self.ring is not None:
                    try:
                        self.ring.give(vaddr, nr * PAGE)
                    except ValueError as e:
                        self._fail(e)
                elif cmd in (PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE):
                    self._queue(CLOSE)
                else:
                    self._fail(
                        ValueError(f"unexpected page server command {cmd:#x} from lazy-pages")
                    )
        finally:
            self._queue(StopAsyncIteration)
            if self.ring is not None:
                self.ring.close()  # a sender waiting for room goes
            await sender

    def _queue(self, item, kind: int = BACKGROUND) -> None:
        self._queues[kind].append(item)
        self._wake.set()

    def _locate(self, dst: int, vaddr: int, nr: int):
        pm = self.maps.get(dst)
        if pm is None:
            raise PageDamaged(f"lazy-pages asked for process {dst}, which is not in the image")
        try:
            ranges = pm.locate(vaddr, nr)
        except PagemapError as e:
            raise PageDamaged(f"lazy-pages asked for {nr} pages at {vaddr:#x}: {e}") from e
        return self.sources[pm.pages_file], ranges

    def _in_order(self, source, ranges: list[tuple[int, int]], kind: int) -> bool:
        """Whether this request goes on in its pages file where the last answer or request
        of its kind for that file ended: the daemon's transfer goes through a process's
        memory in address order, which is file order, one run of present pages after
        another (a GPU process's memory is thousands of runs; the next run's address is not
        where the last ended, its offset in the file is); so do the faults of a reader going
        through memory in order. Never for the pages around a fault: they go on in order
        for up to 4 MiB and stop, and reading ahead of each fault's cluster would read 48
        MiB at every one (170 at a time for a GPU kernel), pushing the transfer's read-ahead
        out of memory."""
        if kind == AROUND:
            return False
        off, key = ranges[0][0], (source.name, kind)
        in_order = off in (self._next.get(key), self._asked.get(key))
        self._asked[key] = ranges[-1][0] + ranges[-1][1]
        return in_order

    def _cached(
        self, source, ranges: list[tuple[int, int]], in_order: bool
    ) -> asyncio.Future | None:
        """The answer as a done future, ``(pages, views, pages file, offset after them)``,
        when all of it is checked and in memory already; else None."""
        parts: list[memoryview] = []
        for off, n in ranges:
            views, m = source.prefix(off, n)
            if m < n:
                return None
            parts += views
        end = ranges[-1][0] + ranges[-1][1]
        if in_order and self.ahead:
            source.ahead(end, self.ahead)
        fut = asyncio.get_running_loop().create_future()
        fut.set_result((sum(n for _, n in ranges) // PAGE, parts, source.name, end))
        return fut

    def _read(self, source, ranges: list[tuple[int, int]], in_order: bool, kind: int) -> tuple:
        """Read and check what the request asks for: ``(pages, views, pages file, offset
        after them)``. A fault's pages are read in the blocks that hold them
        (:meth:`.RawPages.read_once`), not the 1 MiB segments around them, since a thread
        waits for it (on the H100 its answer came after 1.3-1.6 ms instead of 3.1-3.6 ms at
        the median); the pages around it, asked next, load the segments."""
        t = time.perf_counter()
        end = ranges[-1][0] + ranges[-1][1]
        if in_order and self.ahead:
            source.ahead(end, self.ahead)
        if kind == FAULT:
            parts = [memoryview(source.read_once(off, n)) for off, n in ranges]
        else:
            parts = [view for off, n in ranges for view in source.read(off, n)]
        self.read_s += time.perf_counter() - t
        return sum(n for _, n in ranges) // PAGE, parts, source.name, end

    def _fits(self, item, kind: int) -> bool:
        """Whether a read answer has room in the shared memory now (always without it, and
        for one that goes by the socket). The background transfer fills half of it at most."""
        ring, fut = self.ring, item[2]
        if ring is None or ring.closed or fut.cancelled() or fut.exception() is not None:
            return True
        n = fut.result()[0] * PAGE
        return not ring.carries(n) or ring.room(n, kind == BACKGROUND)

    def _pick(self):
        """The next answer to send, or None: the first that is read (and has room in the
        shared memory), faults' first, then the pages around them, then the rest in request
        order (so that the daemon's status goes last, and a daemon without our patches gets
        its answers in order)."""
        self._full = False
        for kind, q in enumerate(self._queues[:BACKGROUND]):
            for i, item in enumerate(q):
                if item[2].done():
                    if not self._fits(item, kind):
                        self._full = True
                        continue
                    del q[i]
                    return item
        q = self._queues[BACKGROUND]
        if q and (not isinstance(q[0], tuple) or q[0][2].done()):
            if isinstance(q[0], tuple) and not self._fits(q[0], BACKGROUND):
                self._full = True
                return None
            return q.popleft()
        return None

    async def _waiting(self) -> None:
        """Until a request comes, an answer waiting to go is read, or the daemon gives back
        shared memory an answer waits for."""
        self._wake.clear()
        futs = [item[2] for q in self._queues[:BACKGROUND] for item in q if not item[2].done()]
        q = self._queues[BACKGROUND]
        if q and isinstance(q[0], tuple) and not q[0][2].done():
            futs.append(q[0][2])
        wakes = [asyncio.ensure_future(self._wake.wait())]
        if self._full:
            wakes.append(asyncio.ensure_future(self.ring.wait_given()))
        try:
            await asyncio.wait([*wakes, *futs], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in wakes:
                w.cancel()

    async def _send(self, writer: asyncio.StreamWriter) -> None:
        while True:
            item = self._pick()
            if item is None:
                t = time.monotonic()
                # the daemon has not given back room for what is read (it copies), or
                # what is asked for is still being read, or nothing is asked for
                why = "send" if self._full else "read" if any(self._queues) else "idle"
                await self._waiting()
                self.waited[why] += time.monotonic() - t
                continue
            if item is StopAsyncIteration:
                return
            if self.failure is not None:
                continue
            if item is CLOSE:  # the daemon is done: its status
                writer.write(struct.pack("<i", 0))
                await writer.drain()
                self.closed.set()
                continue
            vaddr, dst, fut, kind, row = item
            try:
                nr, data, name, end = fut.result()
            except Exception as e:
                self._fail(e)
                continue
            self._next[name, kind] = end
            t = time.monotonic()
            if self.ring is not None and self.ring.carries(nr * PAGE):
                # _pick saw room for it
                off = self.ring.take(nr * PAGE, kind == BACKGROUND)
                if off is None:
                    return  # closed: the daemon is gone
                t_put = time.monotonic()
                self.ring.put(data, off)
                self.put_s += time.monotonic() - t_put
                flags = (PE_PRESENT | PE_SHM) << PS_CMD_BITS
                writer.write(IOV.pack(PS_IOV_ADD_F | flags, nr, vaddr, dst) + SHM_OFFSET.pack(off))
            else:
                writer.write(IOV.pack(PS_IOV_ADD_F | PE_PRESENT << PS_CMD_BITS, nr, vaddr, dst))
                writer.writelines(data)
            try:
                await writer.drain()
            except ConnectionError:
                return
            self.last_at = time.monotonic()
            row[5] = time.time()
            self.waited["send"] += self.last_at - t
            self.bytes += nr * PAGE

    def write_trace(self, path) -> None:
        """Write :attr:`trace` to ``path``: a line per request, ``read written kind process
        vaddr pages`` (times in seconds of the wall clock, ``-`` for an answer never sent)."""
        names = ("fault", "around", "background")
        with open(path, "w") as f:
            f.write("# read written kind process vaddr pages\n")
            for read, kind, dst, vaddr, nr, written in self.trace:
                done = "-" if written is None else f"{written:.6f}"
                f.write(f"{read:.6f} {done} {names[kind]} {dst} {vaddr:#x} {nr}\n")

    def _fail(self, error: Exception) -> None:
        if self.failure is None:
            self.failure = error
            if self.on_failure is not None:
                self.on_failure(error)

    def close(self) -> None:
        """Drop the connection (only once the tree it served is gone)."""
        if self._writer is not None:
            self._writer.close()
        if self.ring is not None:
            self.ring.release()
        for pool in self._pools[:BACKGROUND]:
            pool.shutdown(wait=False)
