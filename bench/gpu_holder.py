"""A process holding N GiB of data on the GPU, for the suspend bench.

It runs detached (its own session, no pipes to the bench, so CRIU can dump it alone):
``python bench/gpu_holder.py GIB STATE_DIR [GPUS [DATA]]`` (GIB on each of the first GPUS
GPUs, default 1; DATA ``random``, the default, or ``weights``: bf16 ``randn * 0.02``). When ready it writes STATE_DIR/ready;
on SIGUSR1 it writes the sha256 of its GPU data (copied out in 1 GiB chunks) to
STATE_DIR/checksum.<n>, n counting up from 1.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time

import torch

GiB = 1024**3


def main() -> None:
    gib, state = float(sys.argv[1]), sys.argv[2]
    gpus = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    data = sys.argv[4] if len(sys.argv) > 4 else "random"
    n = int(gib * GiB) // 4
    chunks = []
    for gpu in range(gpus):
        device = f"cuda:{gpu}"
        left = n
        gen = torch.Generator(device=device).manual_seed(1234 + gpu)
        while left:
            k = min(left, GiB // 4)
            if data == "weights":  # bf16 like a model's weights, seen as int32 pairs
                w = torch.randn(2 * k, dtype=torch.bfloat16, device=device, generator=gen) * 0.02
                chunks.append(w.view(torch.int32))
            else:
                chunks.append(
                    torch.randint(
                        -(2**31), 2**31 - 1, (k,), dtype=torch.int32, device=device, generator=gen
                    )
                )
            left -= k
        torch.cuda.synchronize(device)
    host = torch.empty(GiB // 4, dtype=torch.int32, pin_memory=True)
    count = [0]

    def checksum(*_):
        h = hashlib.sha256()
        for c in chunks:
            part = host[: c.numel()]
            part.copy_(c)
            h.update(part.numpy().tobytes())
        count[0] += 1
        path = os.path.join(state, f"checksum.{count[0]}")
        with open(path + ".tmp", "w") as f:
            f.write(h.hexdigest())
        os.rename(path + ".tmp", path)

    signal.signal(signal.SIGUSR1, checksum)
    with open(os.path.join(state, "ready"), "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
