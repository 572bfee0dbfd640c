"""Checked page sources of a lazy restore (page_source.py): what the page server checks
ahead of the lazy-pages daemon is still in memory when the daemon asks for it."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from jupyterhub_gpusnap.checkpoint.chunks import ChunkStore
from jupyterhub_gpusnap.checkpoint.page_server import AHEAD
from jupyterhub_gpusnap.checkpoint.page_source import ChunkPages, RawPages
from jupyterhub_gpusnap.checkpoint.page_sums import load_sums, write_sums


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
    pool = ThreadPoolExecutor(2)
    image = tmp_path / "pages-1.img"
    image.write_bytes(os.urandom(1 << 20) * ((AHEAD >> 20) + 8))
    write_sums(tmp_path, [image.name], pool, expected=None)
    reader = ThreadPoolExecutor(4)
    source = RawPages(image, load_sums(tmp_path, image.name, image.stat().st_size), reader)
    assert _checked_ahead(source, reader) == AHEAD
