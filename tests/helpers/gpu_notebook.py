"""A notebook cell that fills GPU memory with seeded data, and what GPU 0 holds (NVML).

``ALLOCATE`` prints the data's sha256 (``digest()`` again after a restore) and the
kernel's uid; ``gpu_used()`` needs ``pynvml.nvmlInit()`` first.
"""

from __future__ import annotations

import pynvml

GiB = 1 << 30


ALLOCATE = """
import hashlib, os, torch
xs = [torch.randn(GiB // 4, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
      for i in range(N)]
def digest():
    h = hashlib.sha256()
    for t in xs:
        h.update(t.cpu().numpy().tobytes())
    return h.hexdigest()
x = 42
torch.cuda.synchronize()
print(digest(), os.getuid())
""".replace("GiB", str(GiB)).replace("N", "1")


def gpu_used() -> tuple[int, set[int]]:
    """(bytes used on GPU 0, pids holding a compute context there)."""
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    used = pynvml.nvmlDeviceGetMemoryInfo(handle).used
    pids = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    return used, pids
