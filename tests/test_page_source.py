"""Checked page sources of a lazy restore (page_source.py, page_server.py): the page server
checks ahead of the lazy-pages daemon's transfer, and what it checked is still in memory
when the daemon asks for it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from jupyterhub_gpusnap.checkpoint.chunks import ChunkStore
from jupyterhub_gpusnap.checkpoint.keys import Key
from jupyterhub_gpusnap.checkpoint.page_server import (
    AHEAD,
    IOV,
    PS_CMD_BITS,
    PS_GET_AROUND,
    PS_GET_URGENT,
    PS_IOV_GET,
    PageServer,
)
from jupyterhub_gpusnap.checkpoint.page_source import ChunkPages, PageDamaged, RawPages
from jupyterhub_gpusnap.checkpoint.page_sums import BLOCK, load_sums, write_sums
from jupyterhub_gpusnap.checkpoint.pagemap import PAGE, Pagemap, Run


def _raw_image(tmp_path, mib: int, pool: ThreadPoolExecutor) -> RawPages:
    """A pages file of ``mib`` MiB (one random MiB over and over) with its page sums, as a
    checked source reading in ``pool``."""
    image = tmp_path / "pages-1.img"
    image.write_bytes(os.urandom(1 << 20) * mib)
    write_sums(tmp_path, [image.name], pool, expected=None)
    return RawPages(image, load_sums(tmp_path, image.name, image.stat().st_size), pool)


@contextlib.asynccontextmanager
async def _serving(source: RawPages, runs: list[Run], pool: ThreadPoolExecutor):
    """A page server for process 7 (``runs`` in ``source``) on a socketpair: (server,
    reader, writer) of the daemon's end; all of it closed afterwards."""
    server = PageServer([Pagemap("pagemap-7.img", 1, runs, pid=7)], {source.name: source}, pool)
    ours, theirs = socket.socketpair()
    serving = asyncio.ensure_future(server.serve(ours))
    reader, writer = await asyncio.open_connection(sock=theirs)
    try:
        yield server, reader, writer
    finally:
        writer.close()
        server.close()
        await asyncio.gather(serving, return_exceptions=True)
        source.close()


def _checked_ahead(source, pool: ThreadPoolExecutor) -> int:
    """Bytes from the start that are checked and in memory after reading ahead AHEAD."""
    source.ahead(0, AHEAD)
    pool.shutdown(wait=True)  # every read ahead has finished
    _, got = source.prefix(0, AHEAD)
    return got


def test_small_chunks_read_ahead_stay_until_asked_for(tmp_path):
    # Memory a GPU process leaves in host buffers is often one byte over and over: it is
    # cut into the smallest chunks (512 KiB). Kept by count (48 chunks: 24 MiB), what the
    # page server had checked ahead was dropped before the daemon asked for it, and every
    # chunk was read twice: a 1 GiB notebook took 16 s to come back instead of 4.
    pool = ThreadPoolExecutor(4)
    store = ChunkStore(tmp_path / ".chunks", pool)
    image = tmp_path / "pages-1.img"
    image.write_bytes(b"\1" * (AHEAD + (16 << 20)))
    refs = store.pack_file(image).chunks
    assert max(n for _, n in refs) <= 1 << 20, "the data should be cut into small chunks"
    reader = ThreadPoolExecutor(4)
    source = ChunkPages(store, "plain", image.name, refs, reader)
    assert _checked_ahead(source, reader) == AHEAD


def test_raw_segments_read_ahead_stay_until_asked_for(tmp_path):
    reader = ThreadPoolExecutor(4)
    source = _raw_image(tmp_path, (AHEAD >> 20) + 8, reader)
    assert _checked_ahead(source, reader) == AHEAD


def test_blocks_whose_sum_is_that_of_zeros_are_not_read(tmp_path):
    # A GPU process's image holds plenty of zero-filled buffers; an eager restore reads
    # them from the disk. A block whose checksum is that of zero bytes has a known content:
    # the page source serves it without reading it. Segment 0: all zero; segment 1: zero
    # and random blocks in turn; segment 2: random; then a short zero block at the end.
    block, seg = BLOCK, 1 << 20
    mixed = b"".join(os.urandom(block) if i % 2 else bytes(block) for i in range(seg // block))
    content = bytes(seg) + mixed + os.urandom(seg) + bytes(4096)
    image = tmp_path / "pages-1.img"
    image.write_bytes(content)
    pool = ThreadPoolExecutor(2)
    write_sums(tmp_path, [image.name], pool, expected=None)
    sums = load_sums(tmp_path, image.name, len(content))
    zero = sorted(sums.zero)
    assert zero == [*range(16), *range(16, 32, 2), 48], "the zero blocks, the short one too"
    # damage every zero block on the disk: none of them is read, so each still reads zeros
    with open(image, "r+b") as f:
        for i in zero:
            f.seek(i * block + 7)
            f.write(b"\xff")
    source = RawPages(image, sums, pool)
    got = b"".join(bytes(v) for v in source.read(0, len(content)))
    assert got == content
    assert source.zero_bytes == 16 * block + 8 * block + 4096
    source.close()
    # a damaged byte in a block that is read is found as before
    with open(image, "r+b") as f:
        f.seek(seg + block + 5)  # block 17: random
        f.write(bytes([content[seg + block + 5] ^ 1]))
    source = RawPages(image, sums, pool)
    with pytest.raises(PageDamaged, match=f"block at offset {seg + block} "):
        source.read(seg, seg)
    source.close()
    pool.shutdown()


@pytest.mark.parametrize("sealed", [False, True])
def test_chunks_whose_id_is_that_of_zeros_are_not_read(tmp_path, sealed):
    # A GPU notebook's image holds plenty of zero-filled buffers (660 MB of a 1 GiB one's):
    # from files their page sums say so, and a lazy restore maps zero pages there. From the
    # chunk store they were asked for, read and sent, 2.35 GB instead of 1.69. A chunk whose
    # id is that of zero bytes holds zeros: it is known without reading it, sealed or not.
    pool = ThreadPoolExecutor(2)
    keys = [Key("2026-11", os.urandom(32))] if sealed else None
    store = ChunkStore(tmp_path / ".chunks", pool, keys=keys)
    ones = b"\1" * (3 << 20)  # repeated too, but not zeros
    content = os.urandom(1 << 20) + bytes(6 << 20) + ones + os.urandom(1 << 20) + bytes(5 << 20)
    image = tmp_path / "pages-1.img"
    image.write_bytes(content)
    refs = store.pack_file(image).chunks
    source = ChunkPages(store, store.space, image.name, refs, pool)
    ranges = source.zero_ranges()
    assert all(not any(content[a:b]) for a, b in ranges), "a range holds more than zeros"
    assert [a for a, b in ranges] == sorted(a for a, b in ranges)
    found = sum(b - a for a, b in ranges)
    assert found >= 9 << 20, f"{found >> 20} of the 11 MiB of zeros found"
    assert not any(a < (11 << 20) and b > (8 << 20) for a, b in ranges), "the ones taken as zeros"
    # the zero chunks gone from the store: their bytes are still served, unread
    zero_ids = {refs[i][0] for i in source.zero}
    assert all(cid == store.zero_id(store.space, n) for cid, n in refs if cid in zero_ids)
    for cid in zero_ids:
        store.path(store.space, cid).unlink()
    assert b"".join(bytes(v) for v in source.read(0, len(content))) == content
    assert source.zero_bytes == found
    # any other chunk gone is named, as before
    other = next(cid for cid, _ in refs if cid not in zero_ids)
    store.path(store.space, other).unlink()
    fresh = ChunkPages(store, store.space, image.name, refs, pool)
    with pytest.raises(PageDamaged, match=f"chunk {other[:12]}"):
        fresh.read(0, len(content))
    pool.shutdown()


def test_pages_read_once_read_only_the_blocks_that_hold_them(tmp_path):
    # The staging writes the eager pages (stacks, private file mappings): a few pages here
    # and there. Read through whole 1 MiB segments, 47.5 MB of them took 105-114 MB of reads
    # on a GPU notebook's image; read_once reads the page sums' blocks (64 KiB) around them.
    block, seg = BLOCK, 1 << 20
    content = os.urandom(2 * seg) + bytes(seg) + os.urandom(seg)
    image = tmp_path / "pages-1.img"
    image.write_bytes(content)
    pool = ThreadPoolExecutor(2)
    write_sums(tmp_path, [image.name], pool, expected=None)
    sums = load_sums(tmp_path, image.name, len(content))
    source = RawPages(image, sums, pool)
    # two pages across a block boundary, inside segment 0: two blocks read, not the segment
    off = block - PAGE
    assert bytes(source.read_once(off, 2 * PAGE)) == content[off : off + 2 * PAGE]
    assert source.loaded_bytes == 2 * block
    # a page at the file's end; pages from the zero-filled MiB, served unread
    assert bytes(source.read_once(len(content) - PAGE, PAGE)) == content[-PAGE:]
    assert bytes(source.read_once(2 * seg + 5 * PAGE, 3 * PAGE)) == bytes(3 * PAGE)
    assert source.loaded_bytes == 4 * block and source.zero_bytes == block
    # kept nowhere: what read_once read is not in memory for the page server
    assert source.prefix(0, PAGE) == ([], 0)
    # a damaged byte in a block next to those asked for is not read; in one of them, named
    with open(image, "r+b") as f:
        f.seek(3 * block + 9)
        f.write(bytes([content[3 * block + 9] ^ 1]))
    assert bytes(source.read_once(2 * block, PAGE)) == content[2 * block : 2 * block + PAGE]
    with pytest.raises(PageDamaged, match=f"block at offset {3 * block} "):
        source.read_once(3 * block + 2 * PAGE, PAGE)
    with pytest.raises(PageDamaged, match="beyond its"):
        source.read_once(len(content) - PAGE, 2 * PAGE)
    source.close()
    pool.shutdown()


async def test_the_transfer_reads_ahead_across_runs_of_pages(tmp_path):
    # A GPU process's memory is thousands of runs of present pages: the daemon's next
    # request starts at the next run's address, not where the last answer ended, but at
    # the next offset of the pages file. Read-ahead keyed by address never started there.
    pool = ThreadPoolExecutor(2)
    source = _raw_image(tmp_path, 96, pool)
    run = (1 << 20) // PAGE  # pages per run: 1 MiB each, 2 MiB apart in the address space
    runs = [Run(0x10000000 + i * (2 << 20), run, i << 20, 0) for i in range(96)]
    async with _serving(source, runs, pool) as (_, reader, writer):
        for r in runs[:2]:  # the daemon's transfer: one run, then the next
            writer.write(IOV.pack(PS_IOV_GET, run, r.vaddr, 7))
            head = await reader.readexactly(IOV.size)
            assert IOV.unpack(head)[1] == run
            await reader.readexactly(run * PAGE)
        await asyncio.sleep(0)
        pool.shutdown(wait=True)  # the read-ahead the second request started has finished
        _, got = source.prefix(2 << 20, AHEAD)
        assert got == AHEAD, f"{got >> 20} MiB read ahead of the transfer"


async def test_a_fault_is_answered_before_background_requests_asked_before_it(tmp_path):
    # The lazy-pages daemon keeps four background requests per process in flight; a page
    # fault asked after them waited for all four answers (and its read queued behind the
    # read-ahead in the pool) while the kernel it belongs to could not answer. A request
    # flagged PS_GET_URGENT (or PS_GET_AROUND: the pages around a fault) is read on the
    # server's own threads and answered first; the background answers follow in request
    # order.
    pool = ThreadPoolExecutor(1)
    source = _raw_image(tmp_path, 8, pool)
    runs = [Run(0x10000000, 8 << 8, 0, 0)]  # 8 MiB of pages
    async with _serving(source, runs, pool) as (server, reader, writer):
        busy = threading.Event()
        pool.submit(busy.wait)  # the pool is reading ahead: background reads wait their turn
        background = [0x10000000, 0x10000000 + (2 << 20)]
        fault, around = 0x10000000 + (6 << 20), 0x10000000 + (7 << 20)
        for vaddr in background:
            writer.write(IOV.pack(PS_IOV_GET, 16, vaddr, 7))
        writer.write(IOV.pack(PS_IOV_GET | PS_GET_URGENT << PS_CMD_BITS, 16, fault, 7))
        writer.write(IOV.pack(PS_IOV_GET | PS_GET_AROUND << PS_CMD_BITS, 16, around, 7))
        first = {}
        try:
            for _ in range(2):
                head = await asyncio.wait_for(reader.readexactly(IOV.size), 10)
                _, nr, vaddr, dst = IOV.unpack(head)
                first[vaddr] = (dst, nr, await reader.readexactly(nr * PAGE))
        finally:
            busy.set()
        data = source.path.read_bytes()
        assert first == {
            fault: (7, 16, data[6 << 20 :][: 16 * PAGE]),
            around: (7, 16, data[7 << 20 :][: 16 * PAGE]),
        }, "the fault (and the pages around it) waited for the background answers"
        for want in background:  # then the background, in request order
            _, nr, vaddr, _ = IOV.unpack(await reader.readexactly(IOV.size))
            assert (vaddr, nr) == (want, 16)
            await reader.readexactly(nr * PAGE)
        assert (server.requests, server.faults) == (4, 2)
    pool.shutdown()


async def test_a_fault_reads_only_the_blocks_that_hold_its_pages(tmp_path):
    # A fault's thread waits for its answer: read through whole 1 MiB segments, a GPU
    # kernel's faults were answered after 3.1-3.6 ms at the median on the H100, 1.3-1.6 ms
    # read in the page sums' 64 KiB blocks. The pages around it, and the background
    # transfer, still read and keep whole segments.
    pool = ThreadPoolExecutor(2)
    source = _raw_image(tmp_path, 4, pool)
    data = source.path.read_bytes()
    async with _serving(source, [Run(0x10000000, 4 << 8, 0, 0)], pool) as (_, reader, writer):
        asked = [  # (flags, first page, pages, bytes read after it)
            (PS_GET_URGENT, 1 << 8, 16, BLOCK),  # 64 KiB from the start of segment 1
            (PS_GET_URGENT, (2 << 8) + 8, 16, 3 * BLOCK),  # across a block boundary
            (PS_GET_AROUND, 1 << 8, 32, 3 * BLOCK + (1 << 20)),  # segment 1, whole
            (0, 3 << 8, 16, 3 * BLOCK + (2 << 20)),  # segment 3, whole
        ]
        for flags, page, nr, loaded in asked:
            vaddr = 0x10000000 + page * PAGE
            writer.write(IOV.pack(PS_IOV_GET | flags << PS_CMD_BITS, nr, vaddr, 7))
            head = await asyncio.wait_for(reader.readexactly(IOV.size), 10)
            assert IOV.unpack(head)[1:3] == (nr, vaddr)
            assert await reader.readexactly(nr * PAGE) == data[page * PAGE :][: nr * PAGE]
            assert source.loaded_bytes == loaded, (flags, page, source.loaded_bytes)
    pool.shutdown()


async def test_every_answer_is_the_whole_request(tmp_path):
    # CRIU takes fewer pages than it asked for and asks again for the rest later, but a
    # thread that faulted on a page of the request in flight is not woken by the later one:
    # answered with only what was checked already, a kernel's thread waited for the
    # background transfer to reach its page (8 s at 8 GiB).
    pool = ThreadPoolExecutor(2)
    source = _raw_image(tmp_path, 4, pool)
    source.read(0, PAGE)  # the first segment is checked and in memory, the rest is not
    data = source.path.read_bytes()
    async with _serving(source, [Run(0x10000000, 4 << 8, 0, 0)], pool) as (_, reader, writer):
        for flags in (0, PS_GET_URGENT):
            writer.write(IOV.pack(PS_IOV_GET | flags << PS_CMD_BITS, 3 << 8, 0x10000000, 7))
            head = await asyncio.wait_for(reader.readexactly(IOV.size), 10)
            _, nr, vaddr, _ = IOV.unpack(head)
            assert (vaddr, nr) == (0x10000000, 3 << 8), f"answered {nr} of {3 << 8} pages"
            assert await reader.readexactly(nr * PAGE) == data[: 3 << 20]
    pool.shutdown()


async def test_the_pages_around_a_fault_start_no_read_ahead(tmp_path):
    # The runs after a fault are asked for in file order, up to 4 MiB, and stop there. Read
    # ahead of each such cluster, every fault of a GPU kernel (about 170 while it answers)
    # read 48 MiB more, pushing out of memory what the transfer had read ahead.
    pool = ThreadPoolExecutor(2)
    source = _raw_image(tmp_path, 64, pool)
    run = (1 << 20) // PAGE
    runs = [Run(0x10000000 + i * (2 << 20), run, i << 20, 0) for i in range(64)]
    async with _serving(source, runs, pool) as (_, reader, writer):
        for r in runs[:3]:  # a fault's cluster: one run after the other, in file order
            writer.write(IOV.pack(PS_IOV_GET | PS_GET_AROUND << PS_CMD_BITS, run, r.vaddr, 7))
            _, nr, _, _ = IOV.unpack(await asyncio.wait_for(reader.readexactly(IOV.size), 10))
            await reader.readexactly(nr * PAGE)
        await asyncio.sleep(0)
        pool.shutdown(wait=True)
        _, got = source.prefix(3 << 20, AHEAD)
        assert got == 0, f"{got >> 20} MiB read ahead of the pages around a fault"


async def test_the_server_says_where_the_transfer_waited(tmp_path):
    # What holds a transfer back: answers not yet read and checked when asked for (the
    # disk, the checks: "read"), the daemon not taking what was written (it copies the
    # answer before into the process: "send"), or nothing asked for ("idle").
    pool = ThreadPoolExecutor(1)
    source = _raw_image(tmp_path, 8, pool)
    async with _serving(source, [Run(0x10000000, 8 << 8, 0, 0)], pool) as (server, reader, writer):
        busy = threading.Event()
        pool.submit(busy.wait)  # the pool is busy: the first answer waits for its read
        writer.write(IOV.pack(PS_IOV_GET, 256, 0x10000000, 7))
        await asyncio.sleep(0.3)
        busy.set()
        await reader.readexactly(IOV.size + 256 * PAGE)
        assert server.waited["read"] >= 0.25
        # the answer's time, from the request's arrival, counts the read it waited for
        assert len(server.background_answer_s) == 1 and server.background_answer_s[0] >= 0.25
        # the next MiB goes on where that ended: it starts the read-ahead ...
        writer.write(IOV.pack(PS_IOV_GET, 256, 0x10000000 + (1 << 20), 7))
        await reader.readexactly(IOV.size + 256 * PAGE)
        for _ in range(500):
            if source.prefix(2 << 20, 6 << 20)[1] == 6 << 20:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # ... and nothing is asked for meanwhile
        assert server.from_memory == 0
        # the rest was checked before it was asked for; 6 MiB do not fit in the socket: the
        # answer waits for the daemon to take it
        writer.write(IOV.pack(PS_IOV_GET, 6 << 8, 0x10000000 + (2 << 20), 7))
        await asyncio.sleep(0.3)
        await reader.readexactly(IOV.size + (6 << 20))
        assert server.from_memory == 1 and server.waited["idle"] >= 0.25
        for _ in range(100):
            if server.waited["send"] >= 0.25:
                break
            await asyncio.sleep(0.01)
        assert server.waited["send"] >= 0.25, server.waited
    pool.shutdown()
