"""A GPU notebook suspended and brought back the way a user meets it, against the bare recipe.

For each size (GiB of torch tensors, positional, fractions allowed; default 1 8 24), ``--repeat``
times, the two paths alternating which goes first:

- **gpusnap**: a real JupyterHub and proxy (``tests/helpers/realhub.py``) with
  ``SnapLocalProcessSpawner``, the spawner docs/install.md recommends: the server runs as a
  real Unix user (``--user``, default ``gpusnap-bench``), each in the sandbox of
  ``jupyterhub_gpusnap/sandbox.py`` (root's init, the server and its kernels as the user; no
  ``--allow-root``). The user's server is started through the Hub API and a cell in a real
  ipykernel, sent through the proxy, puts N GiB of random tensors on the GPU (``xs``, 1 GiB
  ``torch.randn`` chunks) and sets ``x = 42``. The server is then suspended as the service
  does it: ``LocalBackend.checkpoint(Server(user, name, state))`` with the spawner state from
  the Hub API, then ``DELETE /users/<user>/server``. Recorded: ``gpu_bytes`` and
  ``image_bytes`` (manifest), ``time_to_gpu_free_s`` (manifest), ``time_to_disk_s`` (the
  checkpoint call, start to verified return: image fsync'ed, processes ended) and
  ``gpu_free_after`` (NVML: no process of the server's tree holds GPU memory and the GPU's used
  memory is back within 256 MiB of what it was before the server started). Then the "click":
  ``POST /users/<user>/server`` until the *same* kernel (same id) answers ``print(x)`` through the
  proxy with 42 (``click_to_kernel_s``; ``click_to_ready_s`` until the Hub lists the server
  ready), then the checksum cell again (``first_tensor_cell_s``; ``intact``: same checksum).
- **bare**: the same jupyter server + kernel workload as the same user, no Hub, the recipe of
  issue 21 done by hand: ``unshare --pid --fork --mount-proc setpriv --reuid U --regid G
  --init-groups setsid sh -c 'exec jupyter server … </dev/null >>log 2>&1'`` (all ids switched
  before the shell, which would drop privileges itself if the real and effective ids
  differed; stdio opened inside the namespaces, the log in a folder the user owns; the
  environment a ``LocalProcessSpawner`` gives: its ``env_keep`` plus HOME, USER, LOGNAME and
  SHELL of the user); the CUDA driver's lock + checkpoint
  through ctypes on every process of the tree holding a CUDA context (``bare_gpu_free_s``);
  ``criu dump --tcp-close --leave-stopped --file-locks --skip-in-flight --ext-mount-map auto
  --enable-external-sharing --enable-external-masters`` of the namespace's init (the same CRIU
  binary as the backend's, ``find_criu()``); every image file
  fsync'ed; the frozen tree killed and waited for. ``bare_dump_s`` is all of that (the same
  steps ``time_to_disk_s`` covers). Then ``criu restore -d --tcp-close --file-locks`` with the
  same mount flags plus ``--root /``, the driver's restore + unlock, until the same kernel
  answers ``print(x)`` (``bare_restore_s``); the checksum cell again (``bare_intact``). CRIU
  runs at its default log level here (the backend asks for ``-v4``).

The user: created when missing (``useradd --create-home --shell /bin/bash``) and kept after
the run (nothing the machine needs is removed); never root. So that it can run the Hub's
Python, the kit's site-packages (``PYTHONPATH``, ``site.getsitepackages()``) and this
checkout (``jupyterhub_gpusnap`` is imported by its server), the folders above them get o+x
for the run, as an install under /opt would have them, and their modes are put back at the
end (SIGTERM included); the run's ``--dir`` gets o+x too (the bare server's folder in it is
the user's). ``server_uid`` / ``bare_server_uid`` (JSON rows and the checks table, with
``server_user`` in the JSON) are the uids the jupyter servers ran as (from /proc), and the
run fails unless they, and the uid each kernel reports, are the user's.

One Hub serves the whole run (its folder and log stay under ``--dir``); the user's server starts
fresh for each run. The bench's own ``LocalBackend`` has the Hub's settings (same
``checkpoint_dir``, ``min_free_bytes = 0``, files storage).

Ratios (per run, then the median), with the targets of issue 21: ``gpu_free_ratio`` =
time_to_gpu_free_s / bare_gpu_free_s (<= 1.05), ``disk_ratio`` = time_to_disk_s / bare_dump_s
(<= 1.10), ``click_ratio`` = click_to_kernel_s / (bare_restore_s + 1 s) (<= 1.10), and, for
information, ``restore_ratio`` = the backend's restore (manifest ``restore_s``: checks, CRIU,
GPU memory) / (bare criu restore + driver restore).

The checksum (the kernel's ``digest()``), computed on the GPU: for each tensor, seen as 64-bit
words w_j, the sums of w_j and of (2j+1)·w_j modulo 2^64 (an odd weight is invertible modulo
2^64, so a change to any one word changes the second sum; words moved or several changed go
unnoticed only if their changes cancel exactly), plus the first and last 8 words verbatim and
the length, all through sha256. No tensor data is copied to the host.

The page cache is dropped before each restore (``cold_cache``; ``--keep-cache`` keeps it). Only
one image is on disk at a time (each is deleted after its run). Needs root, an NVIDIA GPU with
driver >= 570, PyTorch, CRIU >= 4.2, jupyterhub, jupyter_server, ipykernel and
configurable-http-proxy: ``pip install -e '.[demo]'`` in a Python that has PyTorch,
``npm install -g configurable-http-proxy`` and ``.ci/install-criu.sh`` (docs/install.md).

Usage: ``python3 bench/gpu_notebook.py [GIB ...] [--gib GIB ...] [--repeat N] [--dir DIR]
[--keep-cache] [--user NAME]`` → ``bench/results/gpu_notebook.json`` for the default sizes, else
``gpu_notebook_<sizes>.json`` (``--out NAME`` to choose), written after every size so that a
run cut short (SIGTERM included: servers and Hub are cleaned up) keeps what it measured, with
``error`` and ``partial_runs``. Progress lines carry the seconds since the start; on a failure
the ends of the Hub's and the user's server's logs (and of the bare server's log, when that
path failed) are printed. Exit status 1 when a check failed
(data changed, GPU not freed, a step failed).
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import os
import pwd
import secrets
import shlex
import shutil
import signal
import site
import stat
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from common import ROOT, GiB, print_table, write_json

MiB = 1 << 20
BENCH_USER = "gpusnap-bench"  # --user: the Unix user whose servers are measured
DEFAULT_SIZES = [1.0, 8.0, 24.0]
SLACK = 256 * MiB  # GPU memory that may stay used after a server is gone (NVML's own noise)
TARGETS = {"gpu_free_ratio": 1.05, "disk_ratio": 1.10, "click_ratio": 1.10}
BARE_MOUNT_ARGS = [
    "--ext-mount-map",
    "auto",
    "--enable-external-sharing",
    "--enable-external-masters",
]
SERVER_ARGS = [
    f"--ServerApp.jpserver_extensions={ext}=False"
    for ext in ("jupyterlab", "jupyter_lsp", "notebook_shim")
]
#: What JupyterHub's LocalProcessSpawner passes on from the Hub's environment (Spawner.env_keep's
#: default); the bare server gets the same, plus the user's HOME, USER, LOGNAME and SHELL.
ENV_KEEP = ("PATH", "PYTHONPATH", "CONDA_ROOT", "CONDA_DEFAULT_ENV", "VIRTUAL_ENV", "LANG", "LC_ALL",
            "JUPYTERHUB_SINGLEUSER_APP")  # fmt: skip

T0 = time.monotonic()


def say(message: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s] {message}", flush=True)


class BenchError(RuntimeError):
    """A step did not do what it must; the message says which and where to look."""


# ------------------------------------------------------------------------ the kernel's cells

ALLOCATE = r'''
import hashlib, os, sys, time
try:
    import torch
except ImportError as e:
    raise RuntimeError(f"no PyTorch in the kernel's Python ({sys.executable}): {e}")
if not torch.cuda.is_available():
    raise RuntimeError(f"the kernel ({sys.executable}) sees no GPU")

def _bench_alloc(nbytes, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out, left = [], nbytes // 4
    while left:
        n = min(left, (1 << 30) // 4)
        out.append(torch.randn(n, device="cuda", generator=g))
        left -= n
    return out

def digest():
    """sha256 of, per tensor: length, sum and odd-weighted sum of its 64-bit words (mod 2**64,
    on the GPU), first and last 8 words."""
    h = hashlib.sha256()
    step = 1 << 24
    for t in xs:
        v = t.view(torch.int64)
        total = torch.zeros((), dtype=torch.int64, device=v.device)
        weighted = torch.zeros((), dtype=torch.int64, device=v.device)
        for i in range(0, v.numel(), step):
            part = v[i:i + step]
            w = torch.arange(2 * i + 1, 2 * (i + part.numel()) + 1, 2, dtype=torch.int64, device=v.device)
            total += part.sum()
            weighted += (part * w).sum()
        h.update(repr((v.numel(), total.item(), weighted.item(), v[:8].tolist(), v[-8:].tolist())).encode())
    torch.cuda.empty_cache()
    return h.hexdigest()

_t = time.perf_counter()
xs = _bench_alloc(NBYTES, SEED)
x = 42
torch.cuda.synchronize()
print("DIGEST", digest(), sum(t.numel() * t.element_size() for t in xs), round(time.perf_counter() - _t, 3), os.getuid())
'''
DIGEST_CELL = 'print("DIGEST", digest())'
X_CELL = "print(x)"


def allocate_code(nbytes: int, seed: int) -> str:
    return ALLOCATE.replace("NBYTES", str(nbytes)).replace("SEED", str(seed))


def parse_digest(out: str, what: str) -> tuple[str, list[str]]:
    """The checksum (and the rest of its line) from a cell's output; BenchError otherwise."""
    for line in out.splitlines():
        if line.startswith("DIGEST "):
            words = line.split()
            return words[1], words[2:]
    raise BenchError(f"{what}: no checksum in the kernel's output: {out[-2000:]!r}")


# ------------------------------------------------------------------------ machine checks


def check_gpu_python() -> str:
    """PyTorch with a GPU in this Python (the kernels run it); its version, or exit with why."""
    code = (
        "import torch\n"
        "ok = torch.cuda.is_available()\n"
        "print(torch.__version__, ok, torch.cuda.get_device_name(0) if ok else '-')\n"
    )
    hint = (
        f"bench/gpu_notebook.py needs an NVIDIA GPU and PyTorch in this Python ({sys.executable}); "
        "run it on a GPU machine, in a Python that has both (docs/install.md)"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=180
        )
    except subprocess.TimeoutExpired:
        sys.exit(f"{hint}: 'import torch; torch.cuda.is_available()' took over 180 s")
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        sys.exit(f"{hint}: {last}")
    version, ok, name = (out.stdout.split(None, 2) + ["", "", ""])[:3]
    if ok != "True":
        sys.exit(f"{hint}: torch {version} sees no GPU (torch.cuda.is_available() is False)")
    say(f"torch {version} on {name.strip()}")
    return version


def check_machine(root: Path, sizes: list[float]) -> str:
    """Everything else the bench needs; the CRIU binary, or exit with what is missing."""
    if os.geteuid() != 0:
        sys.exit("bench/gpu_notebook.py needs root (CRIU, namespaces, the CUDA checkpoint API)")
    missing = [m for m in ("jupyterhub", "jupyter_server", "ipykernel", "psutil", "tornado")
               if not _importable(m)]  # fmt: skip
    if missing:
        sys.exit(
            f"not importable by {sys.executable}: {', '.join(missing)} (pip install -e '.[demo]')"
        )
    for tool in ("configurable-http-proxy", "unshare", "setpriv", "setsid"):
        if not shutil.which(tool):
            how = (
                "npm install -g "
                if tool == "configurable-http-proxy"
                else "apt-get install util-linux: "
            )
            sys.exit(f"{tool} not on PATH ({how}{tool})")
    from jupyterhub_gpusnap.checkpoint.criu import find_criu
    from jupyterhub_gpusnap.gpu.cuda import CudaCheckpoint

    criu = find_criu()
    if not criu:
        sys.exit("criu not found: install it with .ci/install-criu.sh")
    cuda = CudaCheckpoint()
    if not cuda.available():
        sys.exit(f"CUDA driver checkpoint API unavailable: {cuda.reason}")
    root.mkdir(parents=True, exist_ok=True)
    need = int(max(sizes) * GiB * 1.15) + 2 * GiB  # one image on disk at a time
    free = shutil.disk_usage(root).free
    if free < need:
        sys.exit(f"{root}: {free / GiB:.1f} GiB free, the {max(sizes):g} GiB run needs about "
                 f"{need / GiB:.1f} GiB; use --dir on a larger disk")  # fmt: skip
    return criu


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def filesystem_of(path: Path) -> str:
    """The file system type and mount point holding ``path`` (from /proc/self/mounts)."""
    real, best = str(path.resolve()), ("", "")
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                mnt, fstype = fields[1], fields[2]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(
                    best[0]
                ):
                    best = (mnt, fstype)
    except OSError:
        pass
    return f"{best[1]} on {best[0]}" if best[0] else "unknown"


# ------------------------------------------------------------------------ the user


def ensure_user(name: str) -> pwd.struct_passwd:
    """The Unix user the servers run as: ``name``, created (``useradd --create-home --shell
    /bin/bash``) if missing, never root, with a home folder. BenchError naming the fix otherwise."""
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        cmd = ["useradd", "--create-home", "--shell", "/bin/bash", name]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
        except FileNotFoundError:
            raise BenchError(
                f"{name} does not exist and there is no useradd on PATH: create the user by "
                "hand or pass --user an existing non-root user"
            ) from None
        if done.returncode != 0:
            raise BenchError(
                f"cannot create the bench user: {shlex.join(cmd)} exited {done.returncode}: "
                f"{done.stderr.strip()}; create it by hand or pass --user an existing non-root user"
            ) from None
        pw = pwd.getpwnam(name)
        say(f"created the user {name} (uid {pw.pw_uid}, home {pw.pw_dir}); it stays after the run")
    if pw.pw_uid == 0 or pw.pw_gid == 0:
        raise BenchError(
            f"--user {name} is uid {pw.pw_uid}, gid {pw.pw_gid}: the bench measures servers run "
            "as a real, unprivileged user; pass another name (default gpusnap-bench)"
        )
    if not os.path.isdir(pw.pw_dir):
        raise BenchError(
            f"{name}'s home {pw.pw_dir} does not exist (the server starts there): "
            f"mkhomedir_helper {name}, or pass another --user"
        )
    return pw


def reach_targets(root: Path) -> list[Path]:
    """What the user's servers must reach: the Hub's Python (as called and resolved), the
    kit's site-packages (``PYTHONPATH``, this Python's site folders), this checkout and the
    run's folder."""
    exe = Path(sys.executable)
    targets = [exe.resolve(), exe.parent, exe.resolve().parent, ROOT, root]
    extra = os.environ.get("PYTHONPATH", "").split(os.pathsep) + site.getsitepackages()
    targets += [Path(p) for p in extra if p and os.path.isabs(p)]
    return [t for t in dict.fromkeys(targets) if t.exists()]


@contextmanager
def traversable(targets: list[Path]):
    """o+x on each target folder and every folder above each target (a clone under /root is
    0700), as an install under /opt would have them; the old modes are put back on exit.
    Yields the folders changed."""
    changed: list[tuple[Path, int]] = []
    try:
        for target in targets:
            for folder in [target, *target.parents] if target.is_dir() else target.parents:
                mode = folder.stat().st_mode
                if not mode & stat.S_IXOTH:
                    changed.append((folder, mode))
                    os.chmod(folder, stat.S_IMODE(mode) | stat.S_IXOTH)
        if changed:
            say("o+x for the run (put back after): " + " ".join(str(f) for f, _ in changed))
        yield [f for f, _ in changed]
    finally:
        for folder, mode in reversed(changed):
            try:
                os.chmod(folder, stat.S_IMODE(mode))
            except OSError as e:
                say(f"WARNING: could not put back the mode {stat.S_IMODE(mode):o} of {folder}: {e}")


def bare_env(pw: pwd.struct_passwd) -> dict[str, str]:
    """The bare server's environment: what a LocalProcessSpawner passes (``ENV_KEEP`` from
    this environment, the user's HOME, USER, LOGNAME, SHELL), unbuffered output."""
    env = {k: os.environ[k] for k in ENV_KEEP if k in os.environ}
    env.update(
        HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name, SHELL=pw.pw_shell or "/bin/sh",
        PYTHONUNBUFFERED="1",
    )  # fmt: skip
    return env


def bare_command(server: list[str], log: Path, pw: pwd.struct_passwd) -> list[str]:
    """``server`` as the user in its own PID + mount namespace with its own /proc, stdio
    opened inside (by the user's shell, after all ids are switched: a shell whose real and
    effective ids differ drops privileges itself)."""
    inner = f"exec {shlex.join(server)} </dev/null >>{shlex.quote(str(log))} 2>&1"
    return [
        "unshare", "--pid", "--fork", "--mount-proc",
        "setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups",
        "setsid", "sh", "-c", inner,
    ]  # fmt: skip


def uid_of(pid: int) -> int | None:
    """The real uid of ``pid`` (None if it is gone)."""
    import psutil

    try:
        return psutil.Process(pid).uids().real
    except psutil.Error:
        return None


def check_uids(tag: str, pw: pwd.struct_passwd, server_uid: int | None, kernel_uid: str) -> None:
    """BenchError unless the jupyter server and its kernel ran as the bench user."""
    if server_uid != pw.pw_uid or kernel_uid != str(pw.pw_uid):
        raise BenchError(
            f"{tag}: the server ran as uid {server_uid}, its kernel as uid {kernel_uid}, not as "
            f"{pw.pw_name} (uid {pw.pw_uid}): the figures would not be those of a user's server"
        )


# ------------------------------------------------------------------------ NVML


class Gpu:
    """NVML in this process: memory used on all GPUs, and which pids hold GPU memory."""

    def __init__(self):
        from jupyterhub_gpusnap.gpu.nvml import Nvml

        self.nv = Nvml()
        if not self.nv.open():
            sys.exit(f"NVML unavailable: {self.nv.reason}")

    def used(self) -> int:
        return sum(self.nv.device_memory_total()) - sum(self.nv.device_memory_free())

    def holders(self, pids: list[int]) -> dict[int, int]:
        out: dict[int, int] = {}
        for per_pid in self.nv.process_memory(list(pids)).values():
            for pid, n in per_pid.items():
                out[pid] = out.get(pid, 0) + n
        return out

    async def wait_back_to(self, base: int, timeout: float = 60) -> bool:
        """Wait until the GPU's used memory is within SLACK of ``base``; False if it never was."""
        deadline = time.monotonic() + timeout
        while await asyncio.to_thread(self.used) > base + SLACK:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True


# ------------------------------------------------------------------------ helpers


async def bounded(coro, seconds: float, what: str):
    """``await coro`` for at most ``seconds``; BenchError naming ``what`` otherwise."""
    try:
        return await asyncio.wait_for(coro, seconds)
    except asyncio.TimeoutError:
        raise BenchError(f"{what} did not finish within {seconds:.0f} s") from None


class Limits:
    """Bounds on each step for a size (generous: about 3x the H100 figures of issue 21)."""

    def __init__(self, gib: float):
        self.start = 180.0
        self.alloc = 180 + 5 * gib
        self.cell = 120 + 2 * gib
        self.checkpoint = 120 + 8 * gib
        self.restore = 120 + 8 * gib
        self.stop = 120 + 2 * gib


def fsync_folder(folder: Path) -> None:
    for p in folder.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def started_at(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time() if pid else None
    except psutil.Error:
        return None


def kill_same(pid: int, started: float | None) -> None:
    """SIGKILL ``pid`` if it is still the process that started at ``started`` (never a
    process that reused its number)."""
    import psutil

    if not pid or started is None:
        return
    try:
        p = psutil.Process(pid)
        if abs(p.create_time() - started) < 0.01:
            p.kill()
    except psutil.Error:
        pass


async def wait_gone(pids: list[int], timeout: float) -> bool:
    from jupyterhub_gpusnap.procs import is_alive

    deadline = time.monotonic() + timeout
    while any(is_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


# ------------------------------------------------------------------------ gpusnap: the Hub path

HUB_CONFIG = """
c.JupyterHub.spawner_class = "jupyterhub_gpusnap.spawner.SnapLocalProcessSpawner"
c.LocalBackend.checkpoint_dir = {ckpt!r}
c.LocalBackend.min_free_bytes = 0
c.SnapLocalProcessSpawner.restore_timeout = {restore_timeout}
c.Spawner.cmd = ["jupyterhub-singleuser"]
c.Spawner.start_timeout = {start_timeout}
c.Spawner.http_timeout = 120
c.Spawner.args = {server_args!r}
c.Spawner.default_url = "/api/status"
"""


async def wait_ready_fast(hub, user: str, timeout: float) -> None:
    """Poll the Hub every 50 ms until ``user``'s server is ready (finer than RealHub.wait_ready)."""
    deadline = time.monotonic() + timeout
    while True:
        model = await hub.get_server(user)
        if model and model.get("ready"):
            return
        if model is None or not model.get("pending"):
            raise BenchError(f"{user}'s server stopped starting: {model}; see {hub.log_file}")
        if time.monotonic() > deadline:
            raise BenchError(
                f"{user}'s server not ready within {timeout:.0f} s; see {hub.log_file}"
            )
        await asyncio.sleep(0.05)


async def wait_page_sums(backend, cid: str, tag: str) -> float | None:
    """Wait for the page sums a lazy restore of a ``files`` checkpoint needs (written in the
    background after the suspension, docs/lazy-restore.md); their seconds, None if none."""
    task = getattr(backend, "page_sums", {}).get(cid)
    if task is None:
        return None
    t = time.monotonic()
    ok = await task
    took = round(time.monotonic() - t, 3)
    say(f"{tag}: page sums {'written' if ok else 'NOT written (the restore will be eager)'} "
        f"{took:.2f} s after the stop")  # fmt: skip
    return took


async def restore_complete(backend, cid: str, t0: float, timeout: float):
    """(seconds from ``t0`` until the restore of ``cid`` is complete, its info): restored
    with every page and the GPU memory back (a lazy restore hands the server out before)."""
    deadline = time.monotonic() + timeout
    while True:
        info = await backend.get(cid)
        if info is not None and info.status in ("restored", "failed"):
            if not (info.extra.get("lazy_pending") or info.extra.get("gpu_pending")):
                return time.monotonic() - t0, info
        if time.monotonic() > deadline:
            raise BenchError(f"checkpoint {cid}: restore not complete within {timeout:.0f} s")
        await asyncio.sleep(0.05)


def server_under(init: int) -> int:
    """The server of the sandbox whose init is ``init`` (its only child; 0 if none)."""
    import psutil

    try:
        kids = psutil.Process(init).children()
    except psutil.Error:
        return 0
    return kids[0].pid if kids else 0


async def gpusnap_run(
    hub, backend, gpu: Gpu, pw: pwd.struct_passwd, gib: float, nbytes: int, seed: int
) -> dict:
    from gpu_suspend import drop_caches

    from jupyterhub_gpusnap.model import Server
    from jupyterhub_gpusnap.procs import tree_pids

    lim = Limits(gib)
    tag = f"{gib:g} GiB gpusnap"
    user = pw.pw_name
    base = await asyncio.to_thread(gpu.used)
    t = time.monotonic()
    await bounded(
        hub.start_server(user, timeout=lim.start), lim.start + 10, f"{tag}: starting the server"
    )
    spawn_s = time.monotonic() - t
    t = time.monotonic()
    kernel, out = await bounded(
        hub.execute(user, allocate_code(nbytes, seed), timeout=lim.alloc), lim.alloc + 10,
        f"{tag}: the allocating cell",
    )  # fmt: skip
    checksum, rest = parse_digest(out, f"{tag}: allocating cell")
    say(f"{tag}: server up in {spawn_s:.1f} s, kernel {kernel[:8]} holds {int(rest[0]) / GiB:.2f} GiB "
        f"(cell {time.monotonic() - t:.1f} s), checksum {checksum[:12]}")  # fmt: skip
    model = await hub.get_server(user)
    state = (model or {}).get("state") or {}
    if not state.get("pid"):
        raise BenchError(f"{tag}: no pid in the server's state from the Hub API: {model}")
    tree = tree_pids(state["pid"])
    server_uid = uid_of(server_under(state["pid"]))  # the sandbox's init is root's; its child
    check_uids(tag, pw, server_uid, rest[2] if len(rest) > 2 else "?")
    held = await asyncio.to_thread(gpu.holders, tree)
    if not held:
        raise BenchError(
            f"{tag}: NVML lists no process of the server's tree {tree} (from the state's pid "
            f"{state['pid']}, {'running' if tree else 'not found'}) on the GPU; state: {state}"
        )

    t = time.monotonic()
    info = await bounded(
        backend.checkpoint(Server(user=user, name="", state=state)),
        lim.checkpoint,
        f"{tag}: checkpoint",
    )
    time_to_disk = time.monotonic() - t
    if info.status != "verified":
        raise BenchError(f"{tag}: checkpoint {info.id} is {info.status}: {info.error}")
    left = await asyncio.to_thread(gpu.holders, tree)
    used_after = await asyncio.to_thread(gpu.used)
    gpu_free_after = not left and used_after <= base + SLACK
    gpu_free_s = info.extra.get("time_to_gpu_free_s") or 0.0
    say(f"{tag}: checkpoint {info.id}: GPU free after {gpu_free_s:.2f} s, on disk after "
        f"{time_to_disk:.2f} s, image {info.image_bytes / GiB:.2f} GiB, GPU freed: {gpu_free_after}")  # fmt: skip
    await bounded(
        hub.stop_server(user, timeout=lim.stop),
        lim.stop + 10,
        f"{tag}: stopping (DELETE) after the checkpoint",
    )
    sums_s = await wait_page_sums(backend, info.id, tag)

    cold = False if KEEP_CACHE else drop_caches()
    say(f"{tag}: click (POST /users/{user}/server)")
    t = time.monotonic()
    complete = asyncio.ensure_future(restore_complete(backend, info.id, t, lim.restore + 120))
    status, data = await hub.api("POST", f"/users/{user}/server", {}, timeout=60)
    if status not in (201, 202):
        raise BenchError(f"{tag}: POST /users/{user}/server: {status} {data}; see {hub.log_file}")
    await wait_ready_fast(hub, user, lim.restore)
    ready_s = time.monotonic() - t
    try:
        _, out = await bounded(
            hub.execute(user, X_CELL, kernel_id=kernel, timeout=lim.cell),
            lim.cell + 10,
            f"{tag}: print(x)",
        )
    except BenchError:
        raise
    except Exception as e:
        raise BenchError(
            f"{tag}: kernel {kernel} does not answer after the start ({type(e).__name__}: {e}); "
            f"was the server restored? see {hub.log_file}"
        ) from e
    click = time.monotonic() - t
    if out.strip() != "42":
        raise BenchError(f"{tag}: print(x) in the restored kernel gave {out!r}, not 42")
    t = time.monotonic()
    _, out = await bounded(
        hub.execute(user, DIGEST_CELL, kernel_id=kernel, timeout=lim.alloc), lim.alloc + 10,
        f"{tag}: the checksum cell after the restore",
    )  # fmt: skip
    first_tensor_cell = time.monotonic() - t
    after, _ = parse_digest(out, f"{tag}: checksum cell after the restore")
    full_restore, done = await bounded(complete, lim.restore + 130, f"{tag}: the whole restore")
    restore_s = (done.extra.get("restore_s") if done else None) or 0.0
    phases = (done.extra.get("restore_phases") if done else None) or {}
    say(f"{tag}: restore ({phases.get('mode', 'eager')}) complete after {full_restore:.2f} s")
    if LOGS_DIR:
        await keep_logs(Path(LOGS_DIR), backend.folder(info.id), f"{gib:g}_{backend.storage}",
                        phases.get("mode", "eager"))  # fmt: skip
    say(f"{tag}: same kernel answered after {click:.2f} s (ready {ready_s:.2f} s, backend restore "
        f"{restore_s:.2f} s); checksum cell {first_tensor_cell:.2f} s, intact: {after == checksum}")  # fmt: skip

    await bounded(
        hub.stop_server(user, timeout=lim.stop),
        lim.stop + 10,
        f"{tag}: stopping the restored server",
    )
    released = await gpu.wait_back_to(base)
    if not released:
        say(f"{tag}: WARNING: GPU memory not back to {base / GiB:.2f} GiB used after the stop")
    await backend.delete(info.id)
    return {
        "gpu_bytes": info.gpu_bytes,
        "image_bytes": info.image_bytes,
        "time_to_gpu_free_s": round(gpu_free_s, 3),
        "time_to_disk_s": round(time_to_disk, 3),
        "click_to_kernel_s": round(click, 3),
        "click_to_ready_s": round(ready_s, 3),
        "first_tensor_cell_s": round(first_tensor_cell, 3),
        "full_restore_s": round(full_restore, 3),
        "restore_mode": phases.get("mode", "eager"),
        "storage": getattr(backend, "storage", "files"),
        "page_sums_s": sums_s,
        "restore_s": round(restore_s, 3),
        "gpu_free_after": gpu_free_after,
        "intact": after == checksum,
        "restored": bool(done and done.status == "restored"),
        "cold_cache": bool(cold),
        "spawn_s": round(spawn_s, 3),
        "server_uid": server_uid,
        "checkpoint_phases": {
            k: info.extra.get(k) for k in ("time_to_gpu_free_s", "dump_seconds", "seal_seconds")
        },
        "restore_phases": done.extra.get("restore_phases") if done else None,
        "gpu_used_before_bytes": base,
        "gpu_used_after_bytes": used_after,
        "gpu_released_after_stop": released,
    }


# ------------------------------------------------------------------------ bare: by hand


class BareServer:
    """``jupyter server`` as the user in its own PID + mount namespace with its own /proc, stdio
    opened inside (:func:`bare_command`). ``folder`` (the server's root, its log) becomes the
    user's."""

    def __init__(self, folder: Path, pw: pwd.struct_passwd):
        self.folder = folder
        self.pw = pw
        os.chown(folder, pw.pw_uid, pw.pw_gid)
        self.log = folder / "server.log"
        from tests.helpers.ports import free_port

        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}/"
        self.launcher: subprocess.Popen | None = None
        self.init = 0  # host pid of the namespace's init (the jupyter server)
        self.init_started: float | None = None

    async def start(self, timeout: float) -> None:
        server = [
            sys.executable, "-m", "jupyter_server", "--no-browser",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.folder}", *SERVER_ARGS,
        ]  # fmt: skip
        # unshare's and setpriv's own errors (before sh opens the log inside) go to
        # unshare.log, a file only unshare holds: the dumped tree's stdio is sh's redirections
        with open(self.folder / "unshare.log", "wb") as errors:
            self.launcher = subprocess.Popen(
                bare_command(server, self.log, self.pw),
                stdin=subprocess.DEVNULL, stdout=errors, stderr=errors,
                start_new_session=True, cwd=self.folder, env=bare_env(self.pw),
            )  # fmt: skip
        import psutil
        from tornado.httpclient import AsyncHTTPClient, HTTPRequest

        deadline = time.monotonic() + timeout
        client = AsyncHTTPClient()
        while True:
            if self.launcher.poll() is not None:
                raise BenchError(
                    f"bare jupyter server exited ({self.launcher.returncode}): {self.log_tail()}"
                )
            if not self.init:
                try:
                    kids = psutil.Process(self.launcher.pid).children()
                    if kids:
                        self.init, self.init_started = kids[0].pid, kids[0].create_time()
                except psutil.Error:
                    pass
            try:
                resp = await client.fetch(
                    HTTPRequest(f"{self.base}api/status", headers={"Authorization": f"token {self.token}"},
                                request_timeout=5), raise_error=False,
                )  # fmt: skip
                if resp.code == 200 and self.init:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise BenchError(
                    f"bare jupyter server did not answer within {timeout:.0f} s: {self.log_tail()}"
                )
            await asyncio.sleep(0.1)

    def log_tail(self) -> str:
        text = ""
        for path in (self.folder / "unshare.log", self.log):
            try:
                text += path.read_text(errors="replace")[-2000:]
            except OSError:
                pass
        return text or f"(nothing in {self.log})"

    def kill(self) -> None:
        """SIGKILL the namespace's init (the whole namespace goes with it) and the launcher."""
        kill_same(self.init, self.init_started)
        self.init = 0
        if self.launcher is not None and self.launcher.poll() is None:
            self.launcher.kill()
            try:
                self.launcher.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass


async def execute_bare(
    server: BareServer, kernel: str, code: str, timeout: float, what: str
) -> str:
    from tests.helpers.kernel_ws import execute

    out, _ = await bounded(
        execute(server.base, server.token, kernel, code, timeout), timeout + 10, what
    )
    return out


async def run_criu(args: list[str], timeout: float, what: str, log: Path) -> None:
    from jupyterhub_gpusnap.checkpoint.criu import log_tail

    proc = await asyncio.create_subprocess_exec(
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise BenchError(f"{what} took longer than {timeout:.0f} s; log {log}") from None
    if proc.returncode != 0:
        raise BenchError(f"{what} failed (exit {proc.returncode}); log {log}:\n{log_tail(log)}\n"
                         f"{out.decode(errors='replace')[-1000:]}")  # fmt: skip


async def bare_run(root: Path, criu: str, cuda, gpu: Gpu, pw: pwd.struct_passwd, gib: float,
                   nbytes: int, seed: int, live: list) -> dict:  # fmt: skip
    from gpu_suspend import drop_caches

    from jupyterhub_gpusnap.checkpoint.criu import needs_shell_job, read_pidfile
    from jupyterhub_gpusnap.procs import tree_pids
    from tests.helpers.kernel_ws import new_kernel

    lim = Limits(gib)
    tag = f"{gib:g} GiB bare"
    base = await asyncio.to_thread(gpu.used)
    folder = Path(tempfile.mkdtemp(dir=root, prefix="bare-"))
    server = BareServer(folder, pw)
    live.append(server)
    restored, restored_started = 0, None
    try:
        await server.start(lim.start)
        kernel = await bounded(
            new_kernel(server.base, server.token), 60, f"{tag}: creating a kernel"
        )
        out = await execute_bare(
            server, kernel, allocate_code(nbytes, seed), lim.alloc, f"{tag}: the allocating cell"
        )
        checksum, rest = parse_digest(out, f"{tag}: allocating cell")
        server_uid = uid_of(server.init)  # the namespace's init is the jupyter server
        check_uids(tag, pw, server_uid, rest[2] if len(rest) > 2 else "?")
        tree = tree_pids(server.init)
        cuda_pids = [p for p in tree if await asyncio.to_thread(cuda.state, p) == "running"]
        if not cuda_pids:
            raise BenchError(f"{tag}: no process of the tree {tree} has a CUDA context")
        gpu_bytes = sum((await asyncio.to_thread(gpu.holders, tree)).values())
        images = folder / "images"
        images.mkdir()

        # suspend: driver checkpoint, criu dump, fsync, kill
        t = time.monotonic()
        for p in cuda_pids:
            await asyncio.to_thread(cuda.lock, p, 0)
        for p in cuda_pids:
            await asyncio.to_thread(cuda.checkpoint, p)
        gpu_free_s = time.monotonic() - t
        c = time.monotonic()  # the NVML look is not part of the recipe: left out of the total
        left = await asyncio.to_thread(gpu.holders, tree)
        used_after = await asyncio.to_thread(gpu.used)
        gpu_free_after = not left and used_after <= base + SLACK
        looked = time.monotonic() - c
        shell_job = needs_shell_job(server.init)
        job = ["--shell-job"] if shell_job else []
        c = time.monotonic()
        await run_criu(
            [criu, "dump", "-t", str(server.init), "-D", str(images), "-o", "dump.log", "--tcp-close",
             "--leave-stopped", "--file-locks", "--skip-in-flight", *BARE_MOUNT_ARGS, *job],
            lim.checkpoint, f"{tag}: criu dump", images / "dump.log",
        )  # fmt: skip
        criu_dump_s = time.monotonic() - c
        c = time.monotonic()
        await asyncio.to_thread(fsync_folder, images)
        fsync_s = time.monotonic() - c
        c = time.monotonic()
        server.kill()
        if not await wait_gone(tree, 60):
            raise BenchError(f"{tag}: the dumped tree {tree} is still there 60 s after SIGKILL")
        # a process with tens of GiB closes its sockets only after its memory is freed: CRIU
        # cannot restore the listener before the port is free (the product waits the same way)
        from jupyterhub_gpusnap.procs import port_holder

        while port_holder("127.0.0.1", server.port):
            if time.monotonic() - c > 60:
                raise BenchError(f"{tag}: port {server.port} still taken 60 s after SIGKILL")
            await asyncio.sleep(0.05)
        kill_s = time.monotonic() - c
        dump_s = time.monotonic() - t - looked
        image_bytes = sum(p.stat().st_size for p in images.iterdir() if p.name.endswith(".img"))
        say(f"{tag}: GPU free after {gpu_free_s:.2f} s (freed: {gpu_free_after}), criu dump {criu_dump_s:.2f} s, "
            f"fsync {fsync_s:.2f} s, kill {kill_s:.2f} s: on disk after {dump_s:.2f} s, "
            f"image {image_bytes / GiB:.2f} GiB")  # fmt: skip

        # restore: criu restore, driver restore + unlock, the same kernel answers
        cold = False if KEEP_CACHE else drop_caches()
        pidfile = folder / "restore.pid"
        t = time.monotonic()
        await run_criu(
            [criu, "restore", "-D", str(images), "-d", "--pidfile", str(pidfile), "-o", "restore.log",
             "--tcp-close", "--file-locks", *BARE_MOUNT_ARGS, "--root", "/", *job],
            lim.restore, f"{tag}: criu restore", images / "restore.log",
        )  # fmt: skip
        criu_restore_s = time.monotonic() - t
        restored = read_pidfile(pidfile) or 0
        restored_started = started_at(restored)
        if not restored:
            raise BenchError(f"{tag}: criu restore wrote no pid to {pidfile}")
        c = time.monotonic()
        back = [
            p
            for p in tree_pids(restored)
            if await asyncio.to_thread(cuda.state, p) == "checkpointed"
        ]
        for p in back:
            await asyncio.to_thread(cuda.restore, p)
            await asyncio.to_thread(cuda.unlock, p)
        driver_restore_s = time.monotonic() - c
        if len(back) != len(cuda_pids):
            raise BenchError(
                f"{tag}: {len(cuda_pids)} CUDA processes dumped, {len(back)} found checkpointed after the restore"
            )
        out = await execute_bare(
            server, kernel, X_CELL, lim.cell, f"{tag}: print(x) after the restore"
        )
        restore_s = time.monotonic() - t
        if out.strip() != "42":
            raise BenchError(f"{tag}: print(x) in the restored kernel gave {out!r}, not 42")
        out = await execute_bare(
            server, kernel, DIGEST_CELL, lim.alloc, f"{tag}: the checksum cell after the restore"
        )
        after, _ = parse_digest(out, f"{tag}: checksum cell after the restore")
        say(f"{tag}: criu restore {criu_restore_s:.2f} s, driver restore {driver_restore_s:.2f} s, kernel "
            f"answered after {restore_s:.2f} s; intact: {after == checksum}")  # fmt: skip
        rtree = tree_pids(restored)
        kill_same(restored, restored_started)
        await wait_gone(rtree, 60)
        restored = 0
        if not await gpu.wait_back_to(base):
            say(f"{tag}: WARNING: GPU memory not back to {base / GiB:.2f} GiB used after the kill")
        return {
            "bare_gpu_bytes": gpu_bytes,
            "bare_image_bytes": image_bytes,
            "bare_gpu_free_s": round(gpu_free_s, 3),
            "bare_criu_dump_s": round(criu_dump_s, 3),
            "bare_fsync_s": round(fsync_s, 3),
            "bare_kill_s": round(kill_s, 3),
            "bare_dump_s": round(dump_s, 3),
            "bare_criu_restore_s": round(criu_restore_s, 3),
            "bare_driver_restore_s": round(driver_restore_s, 3),
            "bare_restore_s": round(restore_s, 3),
            "bare_gpu_free_after": gpu_free_after,
            "bare_intact": after == checksum,
            "bare_cold_cache": bool(cold),
            "bare_server_uid": server_uid,
        }
    except BaseException:
        print(f"---- last lines of the bare server's logs ({folder})", flush=True)
        print("\n".join(server.log_tail().splitlines()[-40:]), flush=True)
        raise
    finally:
        kill_same(restored, restored_started)
        server.kill()
        live.remove(server)
        shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------------ the runs

KEEP_CACHE = False  # --keep-cache
LOGS_DIR = ""  # --logs


async def keep_logs(logs: Path, folder: Path, prefix: str, mode: str) -> None:
    """--logs: copy a restore's logs from its checkpoint folder into ``logs``, numbered per
    size, storage and mode: CRIU's restore log (where the tree's restore took its time) and,
    for a lazy restore, the daemon's log (every fault and request) and the page server's."""
    from jupyterhub_gpusnap.checkpoint.lazy import LAZY_LOG, PAGE_SERVER_LOG

    logs.mkdir(parents=True, exist_ok=True)
    if mode == "lazy":
        for _ in range(100):  # copied there as the staging folder is cleared, just after
            if (folder / LAZY_LOG).is_file():
                break
            await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)  # the restore log comes with the staging folder's clearing
    found = sorted(folder.glob("restore-*.log"), key=lambda p: (p.stat().st_mtime, p.name))
    kept = {"restore.log": found[-1]} if found else {}
    if mode == "lazy":
        kept.update({name: folder / name for name in (LAZY_LOG, PAGE_SERVER_LOG)})
    n = len(list(logs.glob(f"{prefix}_*_{mode}_restore.log"))) + 1
    for name, src in kept.items():
        with contextlib.suppress(OSError):
            shutil.copyfile(src, logs / f"{prefix}_{n}_{mode}_{name}")


COLUMNS = [
    "gib", "gpu_gib", "image_gib", "time_to_gpu_free_s", "bare_gpu_free_s", "gpu_free_ratio",
    "time_to_disk_s", "bare_dump_s", "disk_ratio", "click_to_kernel_s", "bare_restore_s", "click_ratio",
    "restore_ratio",
]  # fmt: skip
CHECKS = ["gib", "server_uid", "bare_server_uid", "intact", "bare_intact", "gpu_free_after",
          "bare_gpu_free_after", "restored",
          "click_to_ready_s", "first_tensor_cell_s", "restore_s", "bare_criu_dump_s", "bare_fsync_s",
          "bare_criu_restore_s", "bare_driver_restore_s"]  # fmt: skip


def add_ratios(run: dict) -> None:
    def ratio(ours: float, bare: float) -> float | None:
        return round(ours / bare, 3) if ours and bare else None

    run["gpu_free_ratio"] = ratio(run["time_to_gpu_free_s"], run["bare_gpu_free_s"])
    run["disk_ratio"] = ratio(run["time_to_disk_s"], run["bare_dump_s"])
    run["click_ratio"] = ratio(run["click_to_kernel_s"], run["bare_restore_s"] + 1.0)
    bare = run["bare_criu_restore_s"] + run["bare_driver_restore_s"]
    run["restore_ratio"] = ratio(run["restore_s"], bare)


def summarise(gib: float, runs: list[dict], repeat: int) -> dict:
    from gpu_suspend import median

    row: dict = {"gib": gib, "repeat": repeat}
    for k, v in runs[0].items():
        values = [r.get(k) for r in runs]
        if isinstance(v, bool):
            row[k] = all(values)
        elif isinstance(v, (int, float)) and all(isinstance(x, (int, float)) for x in values):
            row[k] = median(values)
        elif not isinstance(v, dict):
            row[k] = v
    row["gpu_gib"] = round(row["gpu_bytes"] / GiB, 2)
    row["image_gib"] = round(row["image_bytes"] / GiB, 2)
    row["runs"] = runs
    return row


def verdicts(rows: list[dict]) -> list[str]:
    """Lines comparing each size's ratios with the targets; failed checks marked."""
    lines = []
    for r in rows:
        parts = []
        for key, label in (
            ("gpu_free_ratio", "GPU free"),
            ("disk_ratio", "disk"),
            ("click_ratio", "click"),
        ):
            if r.get(key) is None:
                parts.append(f"{label} n/a")
                continue
            ok = r[key] <= TARGETS[key]
            parts.append(
                f"{label} {r[key]:.3f}x (target <= {TARGETS[key]:.2f}) {'ok' if ok else 'OVER'}"
            )
        bad = [
            k
            for k in ("intact", "bare_intact", "gpu_free_after", "bare_gpu_free_after", "restored")
            if not r[k]
        ]
        lines.append(
            f"{r['gib']:g} GiB: "
            + "; ".join(parts)
            + (f"; FAILED: {', '.join(bad)}" if bad else "")
        )
    return lines


def show_logs(hub, ckpt: Path, user: str) -> None:
    """Print the ends of the Hub's and the user's server's logs (the machine may not outlive the run)."""
    from jupyterhub_gpusnap.checkpoint.local_layout import encode_name

    server_log = ckpt / encode_name(user) / encode_name("") / "server.log"
    for title, path in (("Hub log", hub.log_file), (f"server log of {user}", server_log)):
        try:
            lines = path.read_text(errors="replace").splitlines()[-40:]
        except OSError:
            continue
        print(f"---- last lines of the {title} ({path})", flush=True)
        print("\n".join(lines), flush=True)


async def main(
    sizes: list[float],
    root: Path,
    repeat: int,
    name: str,
    torch_version: str,
    settings: dict | None = None,
    user: str = BENCH_USER,
    compare: tuple[list[str], list[str]] | None = None,
) -> int:
    criu = check_machine(root, sizes)
    try:
        pw = ensure_user(user)
    except BenchError as e:
        sys.exit(str(e))
    say(f"servers run as {pw.pw_name} (uid {pw.pw_uid}, gid {pw.pw_gid}, home {pw.pw_dir})")
    with traversable(reach_targets(root)):
        if compare is not None:
            return await compare_restores(criu, pw, sizes, root, repeat, name, torch_version,
                                          settings or {}, *compare)  # fmt: skip
        return await measure(criu, pw, sizes, root, repeat, name, torch_version, settings)


async def measure(
    criu: str,
    pw: pwd.struct_passwd,
    sizes: list[float],
    root: Path,
    repeat: int,
    name: str,
    torch_version: str,
    settings: dict | None,
) -> int:
    from jupyterhub_gpusnap.checkpoint.criu import criu_version
    from jupyterhub_gpusnap.checkpoint.local import LocalBackend
    from jupyterhub_gpusnap.gpu.cuda import CudaCheckpoint
    from tests.helpers.realhub import RealHub

    gpu = Gpu()
    cuda = CudaCheckpoint()
    ckpt = root / "checkpoints"
    # against the bare recipe's eager restore: eager too, unless --backend says otherwise
    settings = {"restore_mode": "eager", **(settings or {})}
    backend = LocalBackend(checkpoint_dir=str(ckpt), min_free_bytes=0, **settings)
    await backend.setup()
    for old in await backend.list(pw.pw_name):  # a run cut short before leaves its image here
        say(f"removing checkpoint {old.id} left by an earlier run")
        await backend.delete(old.id)
    for old in root.glob("bare-*"):
        shutil.rmtree(old, ignore_errors=True)
    big = max(sizes)
    config = HUB_CONFIG.format(
        ckpt=str(ckpt), restore_timeout=int(120 + 8 * big), start_timeout=int(180 + 8 * big),
        server_args=SERVER_ARGS,
    ) + "".join(f"c.LocalBackend.{k} = {v!r}\n" for k, v in settings.items())  # fmt: skip
    hub = RealHub(Path(tempfile.mkdtemp(dir=root, prefix="hub-")), config, start_timeout=120)
    live: list[BareServer] = []
    rows: list[dict] = []
    runs: list[dict] = []
    extra = {
        "sizes": sizes, "repeat": repeat, "backend_settings": settings, "dir": str(root), "dir_fs": filesystem_of(root),
        "criu": await criu_version(criu), "torch": torch_version, "targets": TARGETS,
        "hub_log": str(hub.log_file), "server_user": pw.pw_name, "server_uid": pw.pw_uid,
    }  # fmt: skip
    error = None
    try:
        say(f"starting the Hub in {hub.root} (log {hub.log_file})")
        await bounded(hub.start(), 180, "starting the Hub")
        for gib in sizes:
            nbytes = max(MiB, int(gib * GiB) // MiB * MiB)
            seed = 1000 + len(rows)
            runs = []
            for r in range(repeat):
                bare_first = bool(r % 2)
                say(
                    f"{gib:g} GiB run {r + 1}/{repeat} ({'bare' if bare_first else 'gpusnap'} first)"
                )
                run: dict = {"bare_first": bare_first}
                runs.append(run)  # partial_runs in the JSON if the run fails half-way
                for which in ("bare", "gpusnap") if bare_first else ("gpusnap", "bare"):
                    if which == "gpusnap":
                        run.update(await gpusnap_run(hub, backend, gpu, pw, gib, nbytes, seed))
                    else:
                        run.update(
                            await bare_run(root, criu, cuda, gpu, pw, gib, nbytes, seed, live)
                        )
                add_ratios(run)
            rows.append(summarise(gib, runs, repeat))
            runs = []
            write_json(name, rows, **extra, complete=len(rows) == len(sizes), error=None)
    except (Exception, asyncio.CancelledError) as e:
        if isinstance(e, asyncio.CancelledError):  # SIGTERM or Ctrl-C: clean up all the same
            asyncio.current_task().uncancel()
            error = "interrupted (SIGTERM or Ctrl-C)"
        else:
            error = f"{type(e).__name__}: {e}"
        say(f"FAILED: {error}")
        write_json(name, rows, **extra, complete=False, error=error, partial_runs=runs)
        show_logs(hub, ckpt, pw.pw_name)
    finally:
        for server in list(live):
            server.kill()
        say("stopping the Hub and its servers")
        try:
            await asyncio.wait_for(hub.stop(), 120)
        except Exception as e:  # the leftovers are killed by cwd; say so if even that failed
            say(
                f"stopping the Hub failed: {type(e).__name__}: {e}; check for processes under {hub.root}"
            )
    if rows:
        print_table(rows, COLUMNS)
        print_table(rows, CHECKS)
        for line in verdicts(rows):
            print(line, flush=True)
    failed = error is not None or any(
        not r[k] for r in rows for k in ("intact", "bare_intact", "gpu_free_after", "bare_gpu_free_after", "restored")
    )  # fmt: skip
    return 1 if failed else 0


RESTORE_COLUMNS = [
    "gib", "storage", "mode", "click_to_ready_s", "click_to_kernel_s", "first_tensor_cell_s",
    "full_restore_s", "full_vs_eager", "full_vs_files", "lazy_all_in_s", "gpu_started_s",
    "gpu_behind_s", "intact",
]  # fmt: skip
CLICK_GOAL_S = 2.0  # lazy restore: the kernel answers within this, whatever the size
FULL_GOAL = 1.1  # lazy restore: every byte back within this × the eager restore


def restore_ratios(rows: list[dict]) -> None:
    """full_vs_eager (a lazy row's full restore / the eager one's, same size and storage) and
    full_vs_files (a chunks row's / the files one's, same size and mode)."""
    by = {(r["gib"], r["storage"], r["mode"]): r for r in rows}
    for r in rows:
        eager = by.get((r["gib"], r["storage"], "eager"))
        files = by.get((r["gib"], "files", r["mode"]))
        r["full_vs_eager"] = (
            round(r["full_restore_s"] / eager["full_restore_s"], 3)
            if eager and r["mode"] != "eager" else None
        )  # fmt: skip
        r["full_vs_files"] = (
            round(r["full_restore_s"] / files["full_restore_s"], 3)
            if files and r["storage"] != "files" else None
        )  # fmt: skip


def restore_verdicts(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        if r["mode"] != "lazy":
            continue
        click = r["click_to_kernel_s"] <= CLICK_GOAL_S
        ratio = r["full_vs_eager"]
        full = (
            f"{ratio}x eager (goal <= {FULL_GOAL:g}) {'ok' if ratio <= FULL_GOAL else 'OVER'}"
            if ratio is not None
            else "not compared (no eager restore of this size and storage in this run)"
        )
        lines.append(
            f"{r['gib']:g} GiB {r['storage']} lazy: click {r['click_to_kernel_s']:.2f} s "
            f"(goal <= {CLICK_GOAL_S:g} s) {'ok' if click else 'OVER'}; full restore {full}"
        )
    return lines


async def compare_restores(
    criu: str, pw: pwd.struct_passwd, sizes: list[float], root: Path, repeat: int, name: str,
    torch_version: str, settings: dict, modes: list[str], storages: list[str],
) -> int:  # fmt: skip
    """The same GPU notebook restored eagerly and lazily, from raw files and from chunks, in
    one run (one Hub per storage and mode, configured as the service is); no bare path."""
    from gpu_suspend import median

    from jupyterhub_gpusnap.checkpoint.criu import criu_version
    from jupyterhub_gpusnap.checkpoint.local import LocalBackend
    from tests.helpers.realhub import RealHub

    gpu = Gpu()
    ckpt = root / "checkpoints"
    big = max(sizes)
    rows: list[dict] = []
    extra = {
        "sizes": sizes, "repeat": repeat, "backend_settings": settings, "modes": modes,
        "storages": storages, "dir": str(root), "dir_fs": filesystem_of(root),
        "criu": await criu_version(criu), "torch": torch_version,
        "goals": {"click_to_kernel_s": CLICK_GOAL_S, "full_vs_eager": FULL_GOAL},
        "server_user": pw.pw_name, "server_uid": pw.pw_uid,
    }  # fmt: skip
    error = None
    hub = None
    try:
        for storage in storages:
            for mode in modes:
                these = {**settings, "storage": storage, "restore_mode": mode}
                backend = LocalBackend(checkpoint_dir=str(ckpt), min_free_bytes=0, **these)
                await backend.setup()
                for old in await backend.list(pw.pw_name):
                    await backend.delete(old.id)
                config = HUB_CONFIG.format(
                    ckpt=str(ckpt), restore_timeout=int(120 + 8 * big),
                    start_timeout=int(180 + 8 * big), server_args=SERVER_ARGS,
                ) + "".join(f"c.LocalBackend.{k} = {v!r}\n" for k, v in these.items())  # fmt: skip
                hub = RealHub(Path(tempfile.mkdtemp(dir=root, prefix="hub-")), config,
                              start_timeout=120)  # fmt: skip
                extra.setdefault("hub_logs", []).append(str(hub.log_file))
                say(f"{storage} / {mode}: starting the Hub in {hub.root}")
                await bounded(hub.start(), 180, "starting the Hub")
                try:
                    for gib in sizes:
                        nbytes = max(MiB, int(gib * GiB) // MiB * MiB)
                        runs = []
                        for r in range(repeat):
                            say(f"{gib:g} GiB {storage} {mode}: run {r + 1}/{repeat}")
                            run = await gpusnap_run(
                                hub, backend, gpu, pw, gib, nbytes, 2000 + len(rows) + r
                            )
                            if run["restore_mode"] != mode:
                                raise BenchError(
                                    f"{gib:g} GiB {storage}: asked for a {mode} restore, the Hub "
                                    f"restored {run['restore_mode']} (see {hub.log_file})"
                                )
                            runs.append(run)
                        row = {"gib": gib, "storage": storage, "mode": mode, "repeat": repeat}
                        for k in ("click_to_kernel_s", "click_to_ready_s", "first_tensor_cell_s",
                                  "full_restore_s", "restore_s", "time_to_disk_s", "page_sums_s"):  # fmt: skip
                            vals = [x[k] for x in runs if isinstance(x.get(k), (int, float))]
                            row[k] = median(vals) if vals else None
                        for k in ("intact", "restored", "gpu_free_after", "cold_cache"):
                            row[k] = all(x[k] for x in runs)
                        for k in ("lazy_all_in_s", "gpu_started_s", "gpu_behind_s"):
                            vals = [(x.get("restore_phases") or {}).get(k) for x in runs]
                            vals = [v for v in vals if isinstance(v, (int, float))]
                            row[k] = median(vals) if vals else None
                        row["image_gib"] = round(runs[0]["image_bytes"] / GiB, 2)
                        row["runs"] = runs
                        rows.append(row)
                        restore_ratios(rows)
                        write_json(name, rows, **extra, complete=False, error=None)
                finally:
                    await asyncio.wait_for(hub.stop(), 120)
                    hub = None
        write_json(name, rows, **extra, complete=True, error=None)
    except (Exception, asyncio.CancelledError) as e:
        if isinstance(e, asyncio.CancelledError):
            asyncio.current_task().uncancel()
            error = "interrupted (SIGTERM or Ctrl-C)"
        else:
            error = f"{type(e).__name__}: {e}"
        say(f"FAILED: {error}")
        write_json(name, rows, **extra, complete=False, error=error)
        if hub is not None:
            show_logs(hub, ckpt, pw.pw_name)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(hub.stop(), 120)
    if rows:
        print_table(rows, RESTORE_COLUMNS)
        for line in restore_verdicts(rows):
            print(line, flush=True)
    failed = error is not None or any(not r["intact"] or not r["restored"] for r in rows)
    return 1 if failed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="A GPU notebook through a real Hub (suspend, then the user's click) against the bare recipe."
    )
    p.add_argument(
        "sizes", nargs="*", type=float, help="GiB of GPU tensors per size (default 1 8 24)"
    )
    p.add_argument(
        "--gib",
        action="append",
        type=float,
        default=[],
        help="a size in GiB (repeatable; fractions allowed)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs per size, the paths alternating (medians reported)",
    )
    p.add_argument(
        "--dir", default="/tmp/gpusnap-bench", help="checkpoints, bare images and the Hub live here"
    )
    p.add_argument(
        "--keep-cache", action="store_true", help="do not drop the page cache before restores"
    )
    p.add_argument(
        "--logs",
        default="",
        metavar="DIR",
        help="copy each restore's CRIU restore log here, and a lazy restore's lazy-pages.log (every "
        "fault and request, with times) and page-server.log",
    )
    p.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="TRAIT=VALUE",
        help="a LocalBackend setting for the gpusnap path (repeatable), e.g. writeback_during_dump=False",
    )
    p.add_argument(
        "--compare-restore",
        action="store_true",
        help="restore each size eagerly and lazily (--modes), from files and chunks (--storages), "
        "in one run, instead of gpusnap against the bare recipe; results gpu_notebook_restore*.json",
    )
    p.add_argument("--modes", default="eager,lazy", help="with --compare-restore: restore modes")
    p.add_argument("--storages", default="files,chunks", help="with --compare-restore: storages")
    p.add_argument(
        "--user",
        default=BENCH_USER,
        help="the Unix user the servers run as (created with useradd --create-home if missing; "
        "never root; kept after the run)",
    )
    p.add_argument(
        "--out",
        default="",
        help="results file name (default gpu_notebook, or gpu_notebook_<sizes>)",
    )
    a = p.parse_args(argv)
    a.sizes = (a.sizes or []) + a.gib or list(DEFAULT_SIZES)
    if any(g <= 0 for g in a.sizes):
        p.error("sizes must be positive GiB")
    if a.repeat < 1:
        p.error("--repeat must be at least 1")
    if not a.out:
        a.out = (
            "gpu_notebook"
            if a.sizes == DEFAULT_SIZES
            else "gpu_notebook_" + "-".join(f"{g:g}" for g in a.sizes)
        )
        if a.compare_restore:
            a.out = a.out.replace("gpu_notebook", "gpu_notebook_restore", 1)
    a.modes = [m for m in a.modes.split(",") if m]
    a.storages = [x for x in a.storages.split(",") if x]
    if not set(a.modes) <= {"eager", "lazy"} or not set(a.storages) <= {"files", "chunks"}:
        p.error("--modes takes eager,lazy and --storages files,chunks")
    if not a.out.startswith("gpu_notebook") or "/" in a.out:
        p.error("--out must be a name starting with gpu_notebook (written to bench/results/)")
    return a


def run(argv: list[str] | None = None) -> int:
    global KEEP_CACHE, LOGS_DIR
    a = parse_args(argv)
    KEEP_CACHE = a.keep_cache
    LOGS_DIR = a.logs
    say(f"sizes {' '.join(f'{g:g}' for g in a.sizes)} GiB, repeat {a.repeat}, dir {a.dir}")
    torch_version = check_gpu_python()

    async def guarded() -> int:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, task.cancel)  # a killed run still cleans up
        settings = {k: ast.literal_eval(v) for k, _, v in (o.partition("=") for o in a.backend)}
        if a.compare_restore:
            return await main(a.sizes, Path(a.dir), a.repeat, a.out, torch_version, settings,
                              a.user, compare=(a.modes, a.storages))  # fmt: skip
        return await main(a.sizes, Path(a.dir), a.repeat, a.out, torch_version, settings, a.user)

    return asyncio.run(guarded())


if __name__ == "__main__":
    sys.exit(run())
