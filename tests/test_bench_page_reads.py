"""bench/page_reads.py, small: it reads the file through the page source that checks every
byte (so a damaged byte stops it), once per pattern and pool, and reports each against the
sequential read. Correctness only, never timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import page_reads  # noqa: E402

from jupyterhub_gpusnap.checkpoint.page_source import PageDamaged  # noqa: E402


def test_the_bench_reads_every_pattern_with_each_pool_and_writes_its_table(tmp_path):
    env = dict(os.environ, GPUSNAP_BENCH_RESULTS=str(tmp_path / "results"))
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "page_reads.py"), "--mib", "6", "--restores", "2",
         "--threads", "2", "1", "--dir", str(tmp_path), "--name", "reads"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "vs_sequential" in done.stdout
    doc = json.loads((tmp_path / "results" / "reads.json").read_text())
    rows = [(r["pattern"], r["threads"], r["cold"]) for r in doc["rows"]]
    assert rows == [
        ("sequential", None, True),
        ("page source", 2, True),
        ("page source, no read-ahead", 2, True),
        ("page source, cached", 2, False),
        ("page source", 1, True),
        ("page source, no read-ahead", 1, True),
        ("page source, cached", 1, False),
    ]
    assert doc["rows"][0]["vs_sequential"] == 1.0
    assert all(len(r["runs_s"]) == 2 and r["GB_per_s"] > 0 and r["mib"] == 6 for r in doc["rows"])
    assert doc["ahead"] == page_reads.AHEAD
    assert not list(tmp_path.glob("page-reads-*"))  # the pages file is gone


def test_the_page_source_pattern_checks_what_it_reads(tmp_path):
    with ThreadPoolExecutor(2) as pool:
        path = page_reads.make_pages(tmp_path, 3 << 20, pool)
        assert page_reads.read_source(path, pool, page_reads.AHEAD) == 3 << 20
        with open(path, "r+b") as f:  # one byte of the second MiB
            f.seek((1 << 20) + 4097)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(PageDamaged, match="does not match its checksum"):
            page_reads.read_source(path, pool, page_reads.AHEAD)
        assert page_reads.read_sequential(path) == 3 << 20  # unchecked: reads it all
