"""Cell latency on a parked server: from sending a cell to its first output, per GPU data size.

For each size (GiB, argv; default 1 8 24): a ``jupyter server`` with the auto-unpark extension,
a kernel holding that much GPU data, parked through ``park.park`` as the service does; then a cell
that uses the tensor is sent and timed to its first output (``cell_latency_s``). The same
process is parked again and unparked by hand with the driver (``driver_restore_s``), so the
difference shows what auto-unpark adds; ``cell_after_driver_restore_s`` is the same cell
run right after that manual unpark (the first GPU use after a driver restore). ``--repeat N`` (default 3) pairs, the order
alternating; the figures are medians, each run listed. Adds ``cell_latency_s`` to bench/results/park.json rows of
the same size (written by bench/park.py) and writes bench/results/park_cell.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from common import machine, print_table, results_dir

from jupyterhub_gpusnap.gpu.cuda import CudaCheckpoint  # noqa: E402
from jupyterhub_gpusnap.gpu.park import park  # noqa: E402
from jupyterhub_gpusnap.procs import tree_pids  # noqa: E402
from tests.helpers.jupyter_server import JupyterServer  # noqa: E402
from tests.helpers.kernel_ws import execute, new_kernel  # noqa: E402

GiB = 1024**3


async def one(gib: float, repeat: int) -> dict:
    server = JupyterServer(Path(tempfile.mkdtemp()))
    try:
        await server.wait()
        kernel = await new_kernel(server.base, server.token)
        await execute(
            server.base,
            server.token,
            kernel,
            f"import torch\nt = torch.rand({int(gib * GiB) // 4}, device='cuda')\nprint('ok')",
        )
        cuda = CudaCheckpoint()
        pids = tree_pids(server.proc.pid)
        latencies, bare, after_bare, park_s, moved, outputs = [], [], [], [], 0, []
        for i in range(repeat):
            # alternate which goes first: the first restore after a park may differ
            for which in ("cell", "bare") if i % 2 == 0 else ("bare", "cell"):
                parked = await park(pids, cuda)
                park_s.append(parked.seconds)
                moved = max(moved, parked.bytes_moved)
                if which == "cell":
                    out, latency = await execute(
                        server.base, server.token, kernel, "print(float(t[0]))"
                    )
                    latencies.append(latency)
                    outputs.append(bool(out.strip()))
                else:  # the bare figure on the same process: driver restore + unlock by hand
                    t = time.perf_counter()
                    await cuda.resume(parked.pids)
                    bare.append(time.perf_counter() - t)
                    # the same cell right after: what the first GPU use after a restore costs
                    _, first_use = await execute(
                        server.base, server.token, kernel, "print(float(t[0]))"
                    )
                    after_bare.append(first_use)
        latency, driver_restore = statistics.median(latencies), statistics.median(bare)
        return {
            "gib": gib,
            "gpu_bytes": moved,
            "park_s": round(statistics.median(park_s), 3),
            "cell_latency_s": round(latency, 3),
            "driver_restore_s": round(driver_restore, 3),
            "cell_minus_driver_s": round(latency - driver_restore, 3),
            "repeat": repeat,
            "cell_latency_runs_s": [round(x, 3) for x in latencies],
            "driver_restore_runs_s": [round(x, 3) for x in bare],
            "cell_after_driver_restore_s": round(statistics.median(after_bare), 3),
            "output_ok": all(outputs),
        }
    finally:
        server.stop()


async def main(sizes, repeat):
    rows = [await one(g, repeat) for g in sizes]
    print_table(rows, list(rows[0]))
    out = results_dir()
    (out / "park_cell.json").write_text(
        json.dumps({"machine": machine(), "rows": rows}, indent=2) + "\n"
    )
    park_json = out / "park.json"
    if park_json.exists():
        doc = json.loads(park_json.read_text())
        for row in doc.get("rows", []):
            for r in rows:
                if float(row.get("gib", -1)) == float(r["gib"]):
                    row["cell_latency_s"] = r["cell_latency_s"]
        park_json.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("sizes", nargs="*", type=float, default=[1, 8, 24], help="GiB of GPU data")
    p.add_argument("--repeat", type=int, default=3, help="cell/bare pairs per size (medians)")
    a = p.parse_args()
    asyncio.run(main(a.sizes, a.repeat))
