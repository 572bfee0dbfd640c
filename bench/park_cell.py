"""Cell latency on a parked server: from sending a cell to its first output, per GPU data size.

For each size (GiB, argv; default 1 8 24): a ``jupyter server`` with the auto-unpark extension,
a kernel holding that much GPU data, parked through ``park.park`` as the service does; then a cell
that uses the tensor is sent and timed to its first output (``cell_latency_s``). The same
process is parked again and unparked by hand with the driver (``driver_restore_s``), so the
ratio shows what auto-unpark adds. Adds ``cell_latency_s`` to bench/results/park.json rows of
the same size (written by bench/park.py) and writes bench/results/park_cell.json.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from common import machine, print_table, results_dir

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from kernel_ws import execute, new_kernel  # noqa: E402
from test_gpu_park import JupyterServer  # noqa: E402

from jupyterhub_gpusnap.checkpoint.cuda import CudaCheckpoint  # noqa: E402
from jupyterhub_gpusnap.park import park  # noqa: E402
from jupyterhub_gpusnap.signals.nvml import tree_pids  # noqa: E402

GiB = 1024**3


async def one(gib: float) -> dict:
    server = JupyterServer(Path(tempfile.mkdtemp()))
    try:
        await server.wait()
        kernel = await new_kernel(server.base, server.token)
        await execute(server.base, server.token, kernel,
                      f"import torch\nt = torch.rand({int(gib * GiB) // 4}, device='cuda')\nprint('ok')")
        cuda = CudaCheckpoint()
        pids = tree_pids(server.proc.pid)
        parked = await park(pids, cuda)
        out, latency = await execute(server.base, server.token, kernel, "print(float(t[0]))")
        # the bare figure on the same process: park again, driver restore + unlock by hand
        again = await park(pids, cuda)
        t = time.perf_counter()
        await cuda.resume(again.pids)
        driver_restore = time.perf_counter() - t
        return {"gib": gib, "gpu_bytes": parked.bytes_moved, "park_s": round(parked.seconds, 3),
                "cell_latency_s": round(latency, 3), "driver_restore_s": round(driver_restore, 3),
                "cell_minus_driver_s": round(latency - driver_restore, 3), "output_ok": bool(out.strip())}
    finally:
        server.stop()


async def main(sizes):
    rows = [await one(g) for g in sizes]
    print_table(rows, list(rows[0]))
    out = results_dir()
    (out / "park_cell.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2) + "\n")
    park_json = out / "park.json"
    if park_json.exists():
        doc = json.loads(park_json.read_text())
        for row in doc.get("rows", []):
            for r in rows:
                if float(row.get("gib", -1)) == float(r["gib"]):
                    row["cell_latency_s"] = r["cell_latency_s"]
        park_json.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main([float(a) for a in sys.argv[1:]] or [1, 8, 24]))
