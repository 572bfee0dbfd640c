"""bench/scrub.py, small: it runs end to end, every scrub row finds the store intact, and
the bytes it reports add up (replicas double what is written and scrubbed; a verified
re-pack reads back what it would have trusted). Correctness only, never timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_scrub_bench_rows_add_up(tmp_path):
    env = dict(os.environ, GPUSNAP_BENCH_RESULTS=str(tmp_path / "results"))
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scrub.py"), "--gib", "0.02", "--kind", "random",
         "--dir", str(tmp_path / "work"), "--rate-mib", "64"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {
        r["row"]: r for r in json.loads((tmp_path / "results" / "scrub.json").read_text())["rows"]
    }
    new, twice = rows["new"], rows["new, every chunk twice"]
    assert new["written_mib"] > 0 and twice["written_mib"] == 2 * new["written_mib"]
    assert rows["again, trusted"]["written_mib"] == 0 and rows["again, trusted"]["read_mib"] == 0
    assert rows["again, verified"]["read_mib"] == new["written_mib"]
    for name in ("scrub", "scrub, every chunk twice", "scrub at 64 MiB/s"):
        assert rows[name]["intact"] is True, rows[name]
    assert rows["scrub"]["read_mib"] == new["written_mib"]
    assert rows["scrub, every chunk twice"]["read_mib"] == twice["written_mib"]
