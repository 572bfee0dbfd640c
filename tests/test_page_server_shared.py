"""Answers in memory shared with the lazy-pages daemon (page_server.AnswerRing, CRIU patch
0012): the page server puts an answer's pages in a memfd the daemon maps, sends only where
they are, and reuses that memory once the daemon gives it back. Here the test is the daemon,
on the wire; tests/test_lazy_restore.py runs the real one."""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from jupyterhub_gpusnap.checkpoint.page_server import (
    IOV,
    PE_PRESENT,
    PE_SHM,
    PS_CMD_BITS,
    PS_GET_URGENT,
    PS_IOV_ADD_F,
    PS_IOV_GET,
    PS_IOV_PUT,
    SHARED_MIN,
    SHM_OFFSET,
    AnswerRing,
    PageServer,
)
from jupyterhub_gpusnap.checkpoint.page_source import RawPages
from jupyterhub_gpusnap.checkpoint.page_sums import load_sums, write_sums
from jupyterhub_gpusnap.checkpoint.pagemap import PAGE, Pagemap, Run

BASE = 0x10000000


def _raw_image(tmp_path, mib: int, pool: ThreadPoolExecutor) -> RawPages:
    image = tmp_path / "pages-1.img"
    image.write_bytes(os.urandom(mib << 20))
    write_sums(tmp_path, [image.name], pool, expected=None)
    return RawPages(image, load_sums(tmp_path, image.name, image.stat().st_size), pool)


@contextlib.asynccontextmanager
async def _serving(tmp_path, mib: int, ring_mib: int):
    """A page server for process 7 (``mib`` MiB of random pages at BASE) answering through a
    ring of ``ring_mib`` MiB: (server, reader, writer, the ring as the daemon maps it, the
    image's bytes)."""
    pool = ThreadPoolExecutor(2)
    source = _raw_image(tmp_path, mib, pool)
    ring = AnswerRing(ring_mib << 20)
    runs = [Run(BASE, (mib << 20) // PAGE, 0, 0)]
    server = PageServer([Pagemap("pagemap-7.img", 1, runs, pid=7)], {source.name: source}, pool,
                        ring=ring)  # fmt: skip
    ours, theirs = socket.socketpair()
    serving = asyncio.ensure_future(server.serve(ours))
    reader, writer = await asyncio.open_connection(sock=theirs)
    # as the daemon maps it: read-only, from the fd it inherits
    seen = mmap.mmap(ring.fd, ring.size, prot=mmap.PROT_READ)
    try:
        yield server, reader, writer, seen, source.path.read_bytes()
    finally:
        writer.close()
        server.close()
        await asyncio.gather(serving, return_exceptions=True)
        source.close()
        seen.close()
        pool.shutdown()


async def _answer(reader, timeout: float = 10) -> tuple[int, int, int, int]:
    """(flags, pages, vaddr, offset in the shared memory) of the next answer."""
    cmd, nr, vaddr, _ = IOV.unpack(await asyncio.wait_for(reader.readexactly(IOV.size), timeout))
    assert cmd & ((1 << PS_CMD_BITS) - 1) == PS_IOV_ADD_F
    (off,) = SHM_OFFSET.unpack(await reader.readexactly(SHM_OFFSET.size))
    return cmd >> PS_CMD_BITS, nr, vaddr, off


async def test_pages_come_through_the_shared_memory_and_their_room_is_used_again(tmp_path):
    # 48 MiB through a 16 MiB ring, 4 MiB at a time: the server puts each answer's pages
    # there and sends where; only what the daemon gave back is written over.
    async with _serving(tmp_path, 48, 16) as (server, reader, writer, seen, data):
        offsets = []
        for i in range(12):
            writer.write(IOV.pack(PS_IOV_GET, 1024, BASE + (i << 22), 7))
            flags, nr, vaddr, off = await _answer(reader)
            assert flags == PE_PRESENT | PE_SHM and (nr, vaddr) == (1024, BASE + (i << 22))
            assert seen[off : off + (4 << 20)] == data[i << 22 : (i + 1) << 22]
            offsets.append(off)
            writer.write(IOV.pack(PS_IOV_PUT, nr, off, 7))  # copied: give it back
        assert len(set(offsets)) < len(offsets), "the room given back was not used again"
        assert max(offsets) + (4 << 20) <= 16 << 20
        # each answer's pages were copied into the ring, and each answer's time recorded
        assert server.put_s > 0 and len(server.background_answer_s) == 12
        for _ in range(100):
            if server.ring.used == 0:
                break
            await asyncio.sleep(0.01)
        assert server.ring.used == 0 and server.bytes == 48 << 20 and server.failure is None


async def test_the_transfer_fills_half_the_ring_and_a_fault_still_has_room(tmp_path):
    # Not given back, background answers stop at half the ring (the daemon takes answers in
    # the order they come: a fault's answer waits behind no more than that); a fault is
    # answered all the same; one given back lets the next background answer go.
    async with _serving(tmp_path, 64, 32) as (server, reader, writer, seen, data):
        for i in range(8):  # 32 MiB asked for, 16 MiB fit in half the ring
            writer.write(IOV.pack(PS_IOV_GET, 1024, BASE + (i << 22), 7))
        got = [await _answer(reader) for _ in range(4)]
        assert [vaddr for _, _, vaddr, _ in got] == [BASE + (i << 22) for i in range(4)]
        with pytest.raises(asyncio.TimeoutError):
            await _answer(reader, timeout=0.5)
        fault = BASE + (40 << 20)
        writer.write(IOV.pack(PS_IOV_GET | PS_GET_URGENT << PS_CMD_BITS, 16, fault, 7))
        flags, nr, vaddr, off = await _answer(reader)
        assert (nr, vaddr) == (16, fault) and flags & PE_SHM
        assert seen[off : off + 16 * PAGE] == data[40 << 20 :][: 16 * PAGE]
        _, nr, _, off = got[0]
        writer.write(IOV.pack(PS_IOV_PUT, nr, off, 7))
        _, _, vaddr, _ = await _answer(reader)
        assert vaddr == BASE + (4 << 22), "the background transfer did not go on"


async def test_memory_given_back_that_was_not_given_fails_the_server(tmp_path):
    async with _serving(tmp_path, 4, 16) as (server, reader, writer, seen, data):
        writer.write(IOV.pack(PS_IOV_GET, 16, BASE, 7))
        _, nr, _, off = await _answer(reader)
        writer.write(IOV.pack(PS_IOV_PUT, nr, off + PAGE, 7))
        for _ in range(100):
            if server.failure is not None:
                break
            await asyncio.sleep(0.01)
        assert "gave back" in str(server.failure) and "not given" in str(server.failure)


def test_the_ring_wraps_takes_back_out_of_order_and_keeps_half_for_faults():
    ring = AnswerRing(SHARED_MIN)
    try:
        q = SHARED_MIN // 4
        offs = [ring.take(q, background=i < 2) for i in range(3)]
        assert offs == [0, q, 2 * q] and (ring.used, ring.background) == (3 * q, 2 * q)
        assert not ring.room(PAGE, background=True), "the background transfer took over half"
        ring.give(q, q)  # out of order: the oldest is still out, nothing moves yet
        assert ring.background == q and ring.room(q, background=True)
        ring.give(0, q)
        # one quarter free at the end, two at the start: half a ring goes to the start
        assert ring.take(2 * q) == 0
        # the quarter at the end is left behind until the oldest answer is given back
        assert ring.take(q) is None, "a ring used in order gave room out of order"
        ring.give(2 * q, q)
        assert ring.take(q) == 2 * q and ring.take(q) == 3 * q and ring.used == 4 * q
        with pytest.raises(ValueError, match="not given"):
            ring.give(5 * PAGE, PAGE)
        ring.close()
        assert ring.take(PAGE) is None and ring.given.is_set()
    finally:
        ring.release()
    with pytest.raises(ValueError, match="less than twice the largest answer"):
        AnswerRing(SHARED_MIN - PAGE)
