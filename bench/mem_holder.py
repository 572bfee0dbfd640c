"""A process holding N GiB of data in host memory, for the storage bench.

``python bench/mem_holder.py KIND GIB SEED STATE_DIR``; KIND is ``weights`` (bf16 model
weights: PyTorch ``randn * 0.02`` in bfloat16 when PyTorch is installed, else the same
shape of bits — random mantissas, a narrow band of exponents) or ``random`` (the worst
case for compression). The same SEED gives the same bytes in every process (ten users
loading the same model). Runs detached; writes STATE_DIR/ready; on SIGUSR1 writes the
sha256 of its data to STATE_DIR/checksum.<n>.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time

GiB = 1024**3


def seeded_bytes(n: int, seed: int) -> bytearray:
    """``n`` pseudo-random bytes, the same for the same seed (AES-CTR keystream)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    key = hashlib.sha256(f"mem_holder {seed}".encode()).digest()
    enc = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    out = bytearray(n)
    step = 256 << 20
    zeros = bytes(step)
    for i in range(0, n, step):
        k = min(step, n - i)
        out[i : i + k] = enc.update(zeros[:k])
    return out


def weights(n: int, seed: int) -> tuple[bytearray, str]:
    try:
        import torch

        g = torch.Generator().manual_seed(seed)
        t = (torch.randn(n // 2, generator=g) * 0.02).to(torch.bfloat16)
        return bytearray(t.view(torch.uint8).numpy().tobytes()), "torch.randn*0.02 bf16"
    except ImportError:
        out = seeded_bytes(n, seed)
        exponent = bytes(0x3C + (x & 3) for x in range(256))
        out[1::2] = out[1::2].translate(exponent)
        return out, "synthetic bf16 bits"


def main() -> None:
    kind, gib, seed, state = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    n = int(gib * GiB)
    if kind == "weights":
        data, how = weights(n, seed)
    else:
        data, how = seeded_bytes(n, seed), "random bytes"
    count = [0]

    def checksum(*_):
        count[0] += 1
        path = os.path.join(state, f"checksum.{count[0]}")
        with open(path + ".tmp", "w") as f:
            f.write(hashlib.sha256(data).hexdigest())
        os.rename(path + ".tmp", path)

    signal.signal(signal.SIGUSR1, checksum)
    with open(os.path.join(state, "ready"), "w") as f:
        f.write(how)
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
