"""Helpers shared by the benches: describe the machine, print a table, write results as JSON.

Results go to ``bench/results/<name>.json`` (or the folder named by the
``GPUSNAP_BENCH_RESULTS`` environment variable), each with the machine it ran on, so
figures from different machines are never mixed up.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GiB = 1024**3

if str(ROOT) not in sys.path:  # run as `python bench/x.py` from anywhere
    sys.path.insert(0, str(ROOT))


def results_dir() -> Path:
    d = Path(os.environ.get("GPUSNAP_BENCH_RESULTS") or HERE / "results")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def machine() -> dict:
    """What the figures depend on: CPU, memory, kernel, GPUs and driver."""
    info = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "gpus": [],
        "driver": "",
    }
    try:
        from jupyterhub_gpusnap.gpu.nvml import Nvml

        nv = Nvml()
        if nv.open():
            info["gpus"] = nv.device_names()
            info["driver"] = nv.driver_version() or ""
    except Exception:
        pass
    return info


def print_table(rows: list[dict], columns: list[str]) -> str:
    """Print ``rows`` as an aligned text table (floats with 3 decimals) and return it."""

    def fmt(v) -> str:
        if isinstance(v, float):
            return f"{v:.3f}"
        return "" if v is None else str(v)

    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = [
        "  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def write_json(name: str, rows: list[dict], **extra) -> Path:
    """Write ``{"bench", "created", "machine", "rows", ...extra}`` to ``<results>/<name>.json``."""
    path = results_dir() / f"{name}.json"
    doc = {"bench": name, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    doc["machine"] = machine()
    doc.update(extra)
    doc["rows"] = rows
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}", flush=True)
    return path
