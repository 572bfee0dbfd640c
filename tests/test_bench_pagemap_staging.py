"""bench/pagemap_staging.py, small, and what it compares: the pagemap reader and writer a
lazy restore stages with give what protobuf's generic parsing and encoding give, byte for
byte. Correctness only, never timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import pagemap_staging  # noqa: E402

from jupyterhub_gpusnap.checkpoint import protobuf  # noqa: E402
from jupyterhub_gpusnap.checkpoint.pagemap import (  # noqa: E402
    PE_ZERO,
    _entry,
    pagemap_image,
    read_pagemap,
    with_zero_pages,
)


def test_the_bench_times_each_step_and_writes_its_table(tmp_path):
    env = dict(os.environ, GPUSNAP_BENCH_RESULTS=str(tmp_path / "results"))
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "pagemap_staging.py"), "--entries", "400",
         "--zero-mib", "16", "--repeat", "1", "--name", "staging"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads((tmp_path / "results" / "staging.json").read_text())
    assert [r["step"] for r in doc["rows"]] == [
        "read", "read, generic", "zero runs", "write", "write, generic",
    ]  # fmt: skip
    row = doc["rows"][0]
    assert row["entries"] == 404 and row["zero_mib"] == 16 and row["entries_written"] > 404
    assert all(r["seconds"] > 0 for r in doc["rows"])


def test_the_fast_reader_and_writer_agree_with_protobufs_generic_ones(tmp_path):
    image, zero = pagemap_staging.build(1000, 64)
    path = tmp_path / "pagemap-123.img"
    path.write_bytes(image)
    pm = read_pagemap(path)
    # read: the same runs as every record through protobuf.varints
    assert len(pm.runs) == pagemap_staging.generic_read(image) == 1010 and pm.holes == 0
    given, zero_bytes = with_zero_pages(pm, zero)
    assert zero_bytes == 64 << 20
    # write: each entry the bytes protobuf.varint gives field by field, as CRIU writes it
    for run in given.runs:
        fields = ((1, run.vaddr), (2, 0), (4, run.flags), (5, run.nr_pages))
        assert _entry(run) == b"".join(
            protobuf.varint(k << 3) + protobuf.varint(v) for k, v in fields
        )
    out = tmp_path / "given" / "pagemap-123.img"
    out.parent.mkdir()
    out.write_bytes(pagemap_image(image, given))
    back = read_pagemap(out)
    assert back.pages_id == 123 and back.holes == sum(1 for r in given.runs if r.flags & PE_ZERO)
    assert [(r.vaddr, r.nr_pages, r.offset, r.flags) for r in back.runs] == [
        (r.vaddr, r.nr_pages, r.offset, r.flags) for r in given.runs if not r.flags & PE_ZERO
    ]
