"""A PyTorch process holding GPU memory, driven over stdin/stdout, for GPU tests and benches.

Run as a script it is the process (needs PyTorch and a GPU)::

    python tests/helpers/gpu_helpers.py hold --gib 2      # random data, then waits for commands
    python tests/helpers/gpu_helpers.py fill              # takes (almost) all free GPU memory

Commands, one a line: ``checksum`` (sha256 of the data), ``busy`` (matmul loop in a
thread), ``idle`` (stop it), ``touch`` (one GPU operation, proves the GPU is usable),
``quit``. Each answers one line.

Imported, :class:`GpuProcess` starts and drives one (no PyTorch needed in the caller,
which must not hold a CUDA context of its own).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading

GiB = 1024**3
HERE = os.path.abspath(__file__)


class GpuProcess:
    """A helper process; ``pid`` is the process holding GPU memory, ``root_pid`` its tree's root.

    With ``via_shell`` the helper runs under a ``/bin/sh`` parent, as a kernel runs under
    a notebook server, so that process-tree lookups have a tree to walk.
    """

    def __init__(self, args: list[str], via_shell: bool = False, python: str | None = None):
        python = python or os.environ.get("GPU_HELPER_PYTHON") or sys.executable
        cmd = [python, "-u", HERE, *args]
        if via_shell:
            # the trailing ':' keeps sh from exec-ing the child, so sh stays its parent
            cmd = ["/bin/sh", "-c", " ".join(f"'{c}'" for c in cmd) + "; :"]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.root_pid = self.proc.pid
        first = self._line()
        word, _, rest = first.partition(" ")
        if word != "READY":
            raise RuntimeError(f"GPU helper did not start: {first!r}")
        pid, _, nbytes = rest.partition(" ")
        self.pid = int(pid)
        self.nbytes = int(nbytes)

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"GPU helper exited with {code}")
        return line.strip()

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line()

    def checksum(self) -> str:
        answer = self.ask("checksum")
        assert answer.startswith("CHECKSUM "), answer
        return answer.split()[1]

    def busy(self) -> None:
        assert self.ask("busy") == "BUSY"

    def idle(self) -> None:
        assert self.ask("idle") == "IDLE"

    def touch(self) -> str:
        return self.ask("touch")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                self.kill()
        self.proc.wait()

    def kill(self) -> None:
        """Kill the GPU process (and its shell parent): it exits without cleaning up."""
        for pid in {self.pid, self.root_pid}:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        self.proc.wait()


# --- the helper process itself ---------------------------------------------------------


def _main() -> None:
    import hashlib

    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["hold", "fill"])
    parser.add_argument("--gib", type=float, default=1.0)
    opts = parser.parse_args()

    torch.cuda.init()
    if opts.mode == "hold":
        n = int(opts.gib * GiB) // 4
        data = torch.rand(n, device="cuda", dtype=torch.float32)
    else:
        free, _ = torch.cuda.mem_get_info()
        n = (free - 256 * 1024**2) // 4
        data = torch.empty(n, device="cuda", dtype=torch.float32)
    torch.cuda.synchronize()
    print(f"READY {os.getpid()} {n * 4}", flush=True)

    stop = threading.Event()
    started = threading.Event()
    worker: threading.Thread | None = None

    def burn() -> None:
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        events = []
        while not stop.is_set():
            for _ in range(20):
                a = (a @ a).clamp_(-1, 1)
            ev = torch.cuda.Event()
            ev.record()
            events.append(ev)
            started.set()
            if len(events) > 2:  # keep a batch queued: the GPU never runs dry
                events.pop(0).synchronize()
        torch.cuda.synchronize()

    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "checksum":
            h = hashlib.sha256()
            flat = data.view(torch.uint8)
            step = 256 * 1024**2
            for i in range(0, flat.numel(), step):
                h.update(flat[i : i + step].cpu().numpy().tobytes())
            print(f"CHECKSUM {h.hexdigest()}", flush=True)
        elif cmd == "busy":
            stop.clear()
            started.clear()
            worker = threading.Thread(target=burn, daemon=True)
            worker.start()
            started.wait()
            print("BUSY", flush=True)
        elif cmd == "idle":
            stop.set()
            if worker is not None:
                worker.join()
            print("IDLE", flush=True)
        elif cmd == "touch":
            s = float(data[:1024].sum().item())
            print(f"TOUCHED {s}", flush=True)
        elif cmd == "quit":
            break
        else:
            print(f"UNKNOWN {cmd}", flush=True)
    stop.set()


if __name__ == "__main__":
    _main()
