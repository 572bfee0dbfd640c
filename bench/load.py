"""500 servers go idle in one tick: is the Hub still responsive while the service suspends them?

A real JupyterHub (with configurable-http-proxy) holds N running stand-in servers
(``bench/standin_spawner.py``). The service's own :class:`~jupyterhub_gpusnap.watcher.Watcher`,
with its real Hub client, watches them; its checkpoint backend is :class:`TimedBackend`, a
real :class:`~jupyterhub_gpusnap.checkpoint.base.CheckpointBackend` that writes nothing and
takes ``--checkpoint-seconds`` per checkpoint (a stand-in server has no memory to save).
Every suspension then stops its server through the Hub API, as in production.

For each ``--concurrency`` value (``Watcher.suspend_concurrency``):

1. all N servers running; a first tick sees them active;
2. ``idle``: the Hub's latency with the service ticking and nothing to do, for
   ``--baseline-seconds``;
3. the clock moves past the idle window: the next tick finds all N idle at once and takes
   every one on; ticks go on every ``--interval`` seconds until the last is suspended;
   ``load`` is the Hub's latency meanwhile.

The latency is that of ``GET /hub/api/users`` (an admin's token; the Hub's default page,
``api_page_default_limit`` = 200 users with their servers, as the admin page asks for it),
measured by a separate process (``--probe``) so that this process's event loop does not add
to it: one request after another with ``--probe-gap`` seconds between them.

``load1`` is the machine's 1-minute load average at the end of each phase (other work on
the machine shows there). Checked, per run: every server suspended exactly once, at most ``concurrency`` at a time,
all N stopped in the Hub and recorded ``suspended`` with their checkpoint (nothing lost).

Usage: ``python bench/load.py [--servers 500] [--concurrency 2 8 32]``; root puts the Hub's
folder on a tmpfs (``--no-tmpfs`` to keep it on disk). Writes ``bench/results/load.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

from common import print_table, write_json

from jupyterhub_gpusnap.checkpoint.base import CheckpointBackend, CheckpointInfo  # noqa: E402
from jupyterhub_gpusnap.hub import HubClient  # noqa: E402
from jupyterhub_gpusnap.model import Sample, Server, State  # noqa: E402
from jupyterhub_gpusnap.policy import Policy, Rule  # noqa: E402
from jupyterhub_gpusnap.signals.base import SignalSource  # noqa: E402
from jupyterhub_gpusnap.store import Store  # noqa: E402
from jupyterhub_gpusnap.watcher import Watcher  # noqa: E402

IDLE_WINDOW = 3600.0


class TimedBackend(CheckpointBackend):
    """Writes nothing; each checkpoint takes ``seconds``. Counts how many run at once."""

    def __init__(self, seconds: float, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds
        self.started: list[str] = []
        self.running = 0
        self.max_running = 0
        self.infos: dict[str, CheckpointInfo] = {}

    async def checkpoint(self, server: Server) -> CheckpointInfo:
        self.started.append(server.key)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await asyncio.sleep(self.seconds)
        finally:
            self.running -= 1
        info = CheckpointInfo(
            id=f"{server.user}/{server.name or '_default'}/{len(self.started)}",
            user=server.user,
            server_name=server.name,
            created=time.time(),
            status="verified",
            image_bytes=1 << 20,
        )
        self.infos[info.id] = info
        return info

    async def latest(self, user: str, server_name: str) -> CheckpointInfo | None:
        found = [i for i in self.infos.values() if (i.user, i.server_name) == (user, server_name)]
        return max(found, key=lambda i: i.created) if found else None

    async def get(self, checkpoint_id: str) -> CheckpointInfo | None:
        return self.infos.get(checkpoint_id)

    async def list(self, user: str | None = None) -> list[CheckpointInfo]:
        return sorted(self.infos.values(), key=lambda i: i.created, reverse=True)


class QuietSource(SignalSource):
    """Idle samples without I/O: no kernel busy, no CPU or GPU, kernels last active at t0."""

    name = "jupyter"

    def __init__(self, t0: float, **kwargs):
        super().__init__(**kwargs)
        self.t0 = t0

    async def read(self, server: Server, now: float) -> Sample:
        return Sample(time=now, kernels=1, kernels_busy=0, terminals=0,
                      jupyter_last_activity=self.t0, cpu_percent=0.0, gpu_percent=0.0)  # fmt: skip


# ---------------------------------------------------------------- the probe (own process)


def probe(url: str, token: str, out: Path, gap: float) -> None:
    """GET ``url`` one request after another until SIGTERM; write ``[[t, ms, code], …]``."""
    samples: list[list[float]] = []
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    req = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
    while not stop:
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                resp.read()
                code = resp.status
        except Exception as e:  # a failed request is a sample too (its code, or 0)
            code = getattr(e, "code", 0)
        samples.append([time.time(), (time.perf_counter() - t0) * 1000, code])
        time.sleep(gap)
    out.write_text(json.dumps(samples))


class Probe:
    def __init__(self, hub, gap: float, folder: Path):
        self.hub, self.gap, self.folder = hub, gap, folder
        self.proc = None
        self.out = None

    async def start(self, label: str) -> None:
        self.out = self.folder / f"probe-{label}.json"
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--probe", f"{self.hub.hub_api_url}/users",
            self.hub.admin_token, str(self.out), str(self.gap),
        )  # fmt: skip

    async def stop(self) -> list[list[float]]:
        self.proc.send_signal(signal.SIGTERM)
        await self.proc.wait()
        return json.loads(self.out.read_text())


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (nearest rank) of ``values``."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))]


def summary(samples: list[list[float]]) -> dict:
    ms = [s[1] for s in samples]
    codes = Counter(int(s[2]) for s in samples)
    return {
        "requests": len(ms),
        "p50_ms": round(statistics.median(ms), 1),
        "p90_ms": round(percentile(ms, 90), 1),
        "p99_ms": round(percentile(ms, 99), 1),
        "max_ms": round(max(ms), 1),
        "non_200": sum(n for c, n in codes.items() if c != 200),
    }


# ---------------------------------------------------------------- one run


async def respawn(pop, n: int) -> None:
    """Start every server of u00000… that is not running (after the previous run's suspensions)."""
    ready = await pop.ready_names()
    todo = [f"u{i:05d}" for i in range(n) if f"u{i:05d}" not in ready]
    sem = asyncio.Semaphore(10)

    async def spawn(name: str) -> None:
        async with sem:
            status, data = await pop.hub.api("POST", f"/users/{name}/server", {}, timeout=600)
            if status not in (201, 202) and "already" not in str(data):
                raise RuntimeError(f"spawning {name}: {status} {data}")

    await asyncio.gather(*(spawn(u) for u in todo))
    await pop.wait_ready(n)


async def one_run(pop, args, concurrency: int, folder: Path) -> list[dict]:
    n = args.servers
    await respawn(pop, n)
    t0 = time.time()
    clock = [t0 + 60]
    backend = TimedBackend(args.checkpoint_seconds)
    db = folder / f"gpusnap-{concurrency}.sqlite"
    db.unlink(missing_ok=True)
    watcher = Watcher(
        hub=HubClient(api_url=pop.hub.hub_api_url, api_token=pop.hub.admin_token, page_size=200),
        store=Store(f"sqlite:///{db}"),
        policy=Policy(
            rules=[],
            default=Rule(name="load", idle_window=IDLE_WINDOW, warn_before=0, min_running=0),
        ),
        sources=[QuietSource(t0)],
        backend=backend,
        clock=lambda: clock[0],
        suspend_concurrency=concurrency,
    )
    probe = Probe(pop.hub, args.probe_gap, folder)
    rows = []
    try:
        await watcher.tick()
        assert watcher.store.counts_by_state()["active"] == n, watcher.store.counts_by_state()

        # idle: the service ticks, nothing to do
        await probe.start(f"idle-{concurrency}")
        end = time.monotonic() + args.baseline_seconds
        while time.monotonic() < end:
            clock[0] += args.interval
            await watcher.tick()
            await asyncio.sleep(min(args.interval, max(0.0, end - time.monotonic())))
        rows.append({"concurrency": concurrency, "phase": "idle", **summary(await probe.stop()),
                     "load1": os.getloadavg()[0]})  # fmt: skip

        # load: all N idle in one tick, then ticks every interval until the last is suspended
        await probe.start(f"load-{concurrency}")
        t_load = time.perf_counter()
        clock[0] += IDLE_WINDOW + 60
        await watcher.tick()
        taken_on = (
            watcher.store.counts_by_state()["suspending"]
            + watcher.store.counts_by_state()["suspended"]
        )
        ticks = 1
        while watcher._inflight:
            await asyncio.wait(list(watcher._inflight.values()), timeout=args.interval)
            clock[0] += args.interval
            await watcher.tick()
            ticks += 1
        wall = time.perf_counter() - t_load
        samples = await probe.stop()

        counts = watcher.store.counts_by_state()
        lost = [s.key for s in watcher.store.all()
                if s.state != State.suspended or s.checkpoint_id not in backend.infos]  # fmt: skip
        twice = sorted(k for k, c in Counter(backend.started).items() if c > 1)
        ready_after = await pop.ready_count()
        rows.append({
            "concurrency": concurrency, "phase": "load", **summary(samples),
            "taken_on_first_tick": taken_on, "suspended": counts["suspended"],
            "max_running": backend.max_running, "suspend_wall_s": round(wall, 1),
            "ticks": ticks, "still_running_in_hub": ready_after, "lost": len(lost),
            "suspended_twice": len(twice), "load1": os.getloadavg()[0],
        })  # fmt: skip
        if lost or twice or ready_after or backend.max_running > concurrency:
            raise AssertionError(f"lost {lost[:5]}, twice {twice[:5]}, {ready_after} still running, "
                                 f"max {backend.max_running} at once")  # fmt: skip
    finally:
        if probe.proc is not None and probe.proc.returncode is None:
            probe.proc.kill()
        await watcher.wait_idle()
        watcher.store.close()
    return rows


async def run(args) -> list[dict]:
    import scale  # bench/scale.py: the stand-in population

    folder = Path(tempfile.mkdtemp(prefix="gpusnap-load-"))
    mounted = False
    if args.tmpfs and os.geteuid() == 0:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", str(folder)], check=True
        )
        mounted = True
    pop = scale.Population(folder / "pop", page_max=200)
    rows: list[dict] = []
    try:
        await pop.start()
        t = time.perf_counter()
        await pop.grow(args.servers, batch=args.servers, concurrency=10)
        print(f"{args.servers} servers running ({time.perf_counter() - t:.0f}s)", flush=True)
        for c in args.concurrency:
            rows += await one_run(pop, args, c, folder)
            print_table(rows, COLUMNS)
    finally:
        await pop.stop()
        if pop.hub is not None:
            pop.hub.kill_leftovers()
        if mounted and subprocess.run(["umount", str(folder)]).returncode != 0:
            subprocess.run(["umount", "--lazy", str(folder)])
    return rows


COLUMNS = ["concurrency", "phase", "requests", "p50_ms", "p90_ms", "p99_ms", "max_ms", "non_200",
           "max_running", "suspend_wall_s", "suspended", "lost", "load1"]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--probe":
        probe(argv[1], argv[2], Path(argv[3]), float(argv[4]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", type=int, default=500)
    p.add_argument("--concurrency", type=int, nargs="+", default=[2, 8, 32],
                   help="Watcher.suspend_concurrency values, one run each")  # fmt: skip
    p.add_argument("--checkpoint-seconds", type=float, default=0.5,
                   help="how long each stand-in checkpoint takes")  # fmt: skip
    p.add_argument(
        "--interval", type=float, default=5.0, help="seconds between ticks (GpuSnap.interval)"
    )
    p.add_argument("--baseline-seconds", type=float, default=20.0)
    p.add_argument(
        "--probe-gap", type=float, default=0.05, help="seconds between two probe requests"
    )
    p.add_argument("--no-tmpfs", dest="tmpfs", action="store_false",
                   help="keep the Hub's database on disk (default for root: a tmpfs)")  # fmt: skip
    p.add_argument("--name", default="load", help="results file name (bench/results/NAME.json)")
    args = p.parse_args(argv)
    rows = asyncio.run(run(args))
    table = print_table(rows, COLUMNS)
    write_json(args.name, rows, table=table, settings=vars(args))


if __name__ == "__main__":
    main()
