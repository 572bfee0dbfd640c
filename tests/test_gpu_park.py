"""Park a real single-user server's kernel on a real GPU; the next cell unparks it by itself.

Selected with ``-m gpu`` (GPU machine only): a ``jupyter server`` with the auto-unpark
extension, an ipykernel holding GPU data, the service's park path (``park.park`` over the
server's process tree), and cells sent over the kernel websocket.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from jupyterhub_gpusnap.gpu.cuda import CudaCheckpoint, GpuBusy
from jupyterhub_gpusnap.gpu.park import park
from jupyterhub_gpusnap.procs import tree_pids
from tests.helpers.jupyter_server import JupyterServer
from tests.helpers.kernel_ws import execute, new_kernel

pytestmark = pytest.mark.gpu

GiB = 1024**3


def allocate_elsewhere(nbytes: int) -> bool:
    """Another process allocates ``nbytes`` of GPU memory (proves parking freed it)."""
    code = f"import torch; x = torch.empty({nbytes}, dtype=torch.uint8, device='cuda'); print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return out.returncode == 0 and "ok" in out.stdout


async def test_parked_kernel_frees_the_gpu_and_the_next_cell_unparks_it(tmp_path):
    server = JupyterServer(tmp_path)
    try:
        await server.wait()
        kernel = await new_kernel(server.base, server.token)
        out, _ = await execute(
            server.base,
            server.token,
            kernel,
            "import torch\n"
            f"t = torch.rand({8 * GiB // 4}, device='cuda')\n"
            "s = float(t.double().sum()); print('ready', s)",
        )
        assert out.startswith("ready"), out
        cuda = CudaCheckpoint()
        pids = tree_pids(server.proc.pid)
        free_before = torch_free()
        result = await park(pids, cuda)
        assert result.bytes_moved >= 8 * GiB
        # the GPU memory is free for someone else while the server keeps running
        assert torch_free() >= free_before + 8 * GiB - GiB
        assert allocate_elsewhere(int(free_before + 6 * GiB))
        assert server.proc.poll() is None
        # the user runs a cell: it unparks by itself and computes the right answer
        out, latency = await execute(
            server.base, server.token, kernel, "print(float(t.double().sum()) == s)"
        )
        assert out.strip() == "True", out
        assert all(cuda.state(p) in (None, "running") for p in pids)
        print(f"cell latency after park of {result.bytes_moved / GiB:.1f} GiB: {latency:.2f}s")

        # a park while a cell computes is refused ("busy") and nothing changes
        task = asyncio.ensure_future(
            execute(
                server.base,
                server.token,
                kernel,
                "import time\nend = time.time() + 8\n"
                "while time.time() < end: t.mul_(1.0)\nprint('done')",
            )
        )
        await asyncio.sleep(2)
        with pytest.raises(GpuBusy):
            await park(pids, cuda, lock_timeout_ms=1)
        out, _ = await task
        assert out.strip() == "done"
        # and once the cell is over, the retry goes through
        assert (await park(pids, cuda)).bytes_moved > 0
        out, _ = await execute(
            server.base, server.token, kernel, "print(float(t.double().sum()) == s)"
        )
        assert out.strip() == "True"
    finally:
        server.stop()


def torch_free() -> int:
    """Free GPU memory seen by NVML (bytes)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).free
    finally:
        pynvml.nvmlShutdown()
