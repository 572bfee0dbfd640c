"""The storage benches, small, with real CRIU: they run end to end and every restored
process holds the data it held before (``intact``). Correctness only, never timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.criu

ROOT = Path(__file__).resolve().parent.parent


def run_bench(tmp_path: Path, *args: str) -> None:
    env = dict(os.environ, GPUSNAP_BENCH_RESULTS=str(tmp_path / "results"))
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / args[0]), *args[1:], "--dir", str(tmp_path / "work")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_stream_ceiling_restores_three_ways_intact(tmp_path):
    run_bench(tmp_path, "stream_ceiling.py", "--gib", "0.05", "--kind", "random", "--repeat", "1")
    doc = json.loads((tmp_path / "results" / "stream_ceiling_random.json").read_text())
    assert [r["mode"] for r in doc["rows"]] == ["files", "stream, files", "stream, chunks"]
    assert all(r["intact"] is True for r in doc["rows"])
    chunks = doc["rows"][2]
    assert chunks["pipe_kib"] and chunks["waited_criu_s"] is not None
    assert [s["ratio"] for s in doc["summary"]][0] == 1.0


def test_storage_bench_restores_twice_and_reports_the_pipe(tmp_path):
    run_bench(tmp_path, "storage.py", "--gib", "0.05", "--kinds", "random", "--name", "s",
              "--restores", "2")  # fmt: skip
    doc = json.loads((tmp_path / "results" / "s.json").read_text())
    modes = {r["mode"]: r for r in doc["rows"]}
    assert all(r["intact"] for r in doc["rows"])  # both restores of every checkpoint
    assert doc["restores"] == 2
    # each checkpoint restored right after it was taken, then once more in turns across the rows
    rows = [
        f"random: {m}"
        for m in ("files", "chunks", "chunks, again", "chunks, again, unpacked first")
    ]
    assert doc["restore_order"] == rows + rows
    assert all(r["restore_min_s"] <= r["restore_s"] <= r["restore_max_s"] for r in doc["rows"])
    assert modes["files"]["pipe_kib"] is None and modes["chunks"]["pipe_kib"] > 0
    assert modes["chunks, again, unpacked first"]["pipe_kib"] is None
    assert doc["restore_pipe_bytes"] == 16 << 20
