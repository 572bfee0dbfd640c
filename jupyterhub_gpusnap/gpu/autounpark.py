"""Resume a parked kernel's GPU memory as soon as the user runs a cell.

Runs inside the single-user server (loaded by the gpusnap server extension). Parking
checkpoints a kernel's CUDA state into host memory while the process keeps running; a
CUDA call it makes meanwhile simply waits. When a cell starts, the kernel reports
``execution_state == "busy"``; this watcher sees that within ``interval`` seconds and
restores and unlocks the kernel's CUDA processes, so the waiting call goes on.

The kernels run as the same user as the server, which is all the driver's checkpoint
API asks of the caller.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone

from traitlets import Float
from traitlets.config import LoggingConfigurable

from ..procs import tree_pids

PARKED_STATES = ("checkpointed", "locked")


def _iso(ts: float | None) -> str | None:
    """Epoch seconds as the service writes times: ISO 8601, UTC, with a Z."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


def kernel_pid(kernel) -> int | None:
    """The pid of a jupyter_server kernel (local provisioner), or None."""
    provisioner = getattr(kernel, "provisioner", None)
    pid = getattr(provisioner, "pid", None)
    if pid:
        return int(pid)
    proc = getattr(provisioner, "process", None) or getattr(kernel, "kernel", None)
    return getattr(proc, "pid", None)


class AutoUnpark(LoggingConfigurable):
    """Watches the server's kernels and unparks any that go busy while parked."""

    interval = Float(
        0.1,
        help="Seconds between two looks at the kernels' execution state. A parked kernel's first "
        "CUDA call waits at most this long plus the driver's restore time.",
    ).tag(config=True)

    def __init__(self, kernel_manager, cuda=None, **kwargs):
        super().__init__(**kwargs)
        self.kernel_manager = kernel_manager
        if cuda is None:
            from .cuda import CudaCheckpoint

            cuda = CudaCheckpoint(parent=self)
        self.cuda = cuda
        self.unparks: list[
            dict
        ] = []  # recent unparks: kernel, seconds, at (shown by the Lab panel)
        self.resuming: dict[str, float] = {}  # kernel id -> when its unpark started (epoch s)
        self._task: asyncio.Task | None = None

    def state(self) -> dict:
        """What the Lab panel shows of automatic unparks (``GET /gpusnap/autounpark``).

        ``watching`` is false where there is no CUDA checkpoint API (nothing is ever parked
        there). ``resuming`` is true while an unpark runs (from the kernel going busy until its GPU
        memory is back and unlocked); ``resuming_since`` is when the oldest running one
        started; ``last_unpark`` is the newest finished one (``at`` is when it ended).
        """
        last = self.unparks[-1] if self.unparks else None
        return {
            "watching": self._task is not None,
            "resuming": bool(self.resuming),
            "resuming_since": _iso(min(self.resuming.values())) if self.resuming else None,
            "resuming_kernels": sorted(self.resuming),
            "last_unpark": dict(last, at=_iso(last["at"])) if last else None,
        }

    def parked_pids(self, pid: int) -> list[int]:
        return [p for p in tree_pids(pid) if self.cuda.state(p) in PARKED_STATES]

    def parked_kernels(self) -> dict[str, list[int]]:
        """Kernel id → its parked CUDA pids (for the status endpoint)."""
        out = {}
        for kid in list(self.kernel_manager.list_kernel_ids()):
            pid = kernel_pid(self.kernel_manager.get_kernel(kid))
            if pid:
                pids = self.parked_pids(pid)
                if pids:
                    out[kid] = pids
        return out

    async def check_once(self) -> list[str]:
        """Unpark every busy kernel that is parked; return their ids."""
        done = []
        for kid in list(self.kernel_manager.list_kernel_ids()):
            kernel = self.kernel_manager.get_kernel(kid)
            if getattr(kernel, "execution_state", None) != "busy":
                continue
            pid = kernel_pid(kernel)
            if not pid:
                continue
            pids = await asyncio.to_thread(self.parked_pids, pid)
            if not pids:
                continue
            t0 = time.perf_counter()
            self.resuming[kid] = time.time()
            try:
                resumed = await self.cuda.resume(pids)
            finally:
                self.resuming.pop(kid, None)
            seconds = time.perf_counter() - t0
            self.log.info(
                "gpusnap: kernel %s went busy while parked; GPU memory back in %.2fs (pids %s)",
                kid,
                seconds,
                resumed,
            )
            self.unparks = (
                self.unparks + [{"kernel": kid, "seconds": round(seconds, 3), "at": time.time()}]
            )[-10:]
            done.append(kid)
        return done

    async def run(self) -> None:
        while True:
            try:
                await self.check_once()
            except Exception as e:  # never take the server down
                self.log.warning("gpusnap: auto-unpark check failed: %s", e)
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        if self._task is None and self.cuda.available():
            self._task = asyncio.ensure_future(self.run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


def _jupyter_server_extension_points():
    return [{"module": "jupyterhub_gpusnap.gpu.autounpark"}]


def _load_jupyter_server_extension(serverapp) -> None:
    """Start the watcher in a single-user server (enabled with the gpusnap server extension)."""
    watcher = AutoUnpark(serverapp.kernel_manager, parent=serverapp, log=serverapp.log)
    serverapp.web_app.settings["gpusnap_autounpark"] = watcher
    watcher.start()
    if watcher._task is None:
        serverapp.log.info("gpusnap: auto-unpark off (no CUDA driver checkpoint API here)")
