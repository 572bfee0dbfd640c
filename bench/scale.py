"""One service tick over thousands of servers: CPU, wall time, Hub requests, memory.

A real JupyterHub (with configurable-http-proxy) holds N running servers. The servers
are stand-ins (``bench/standin_spawner.py``: one shared HTTP server answers for all),
and signals come from :class:`SimulatedSource`, a real
:class:`~jupyterhub_gpusnap.signals.base.SignalSource` that returns deterministic samples
without I/O, so the figures are the service's own cost: listing servers through the Hub
API (paginated ``GET /users?state=ready``), the policy, the database and metrics.

Measured in this process:

- ``cpu_s``: ``time.process_time()`` around one ``Watcher.tick()`` (this process only;
  the Hub's own work is in ``wall_s``), ``wall_s``: ``time.perf_counter()`` around it;
- ``requests``: Hub API requests of the tick (``HubClient.requests``, and the HTTP
  client's own count, which also covers jupyterhub-idle-culler);
- the first tick (a fresh database: every server is new) and steady ticks apart;
- jupyterhub-idle-culler 2.x's ``cull_idle`` on the same Hub in the same run, with a
  timeout so large it culls nothing, for comparison;
- memory: RSS and ``tracemalloc``'s traced size every 100 ticks over ``--memory-ticks``
  ticks, on a Hub of its own with ``--memory-servers`` servers (default 200).

The Hub's database is kept under ``--cache`` (per N) so a later run skips populating.
Usage: ``python bench/scale.py [--servers 10000] [--page-size 200] [--ticks 5]``.
Writes ``bench/results/scale.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import json
import logging
import os
import pstats
import statistics
import sys
import tempfile
import time
import tracemalloc
import zlib
from pathlib import Path

import psutil
from common import ROOT, print_table, write_json
from tornado.httpclient import HTTPRequest
from tornado.simple_httpclient import SimpleAsyncHTTPClient

from jupyterhub_gpusnap.hub import HubClient
from jupyterhub_gpusnap.model import Sample, Server
from jupyterhub_gpusnap.policy import Policy, Rule
from jupyterhub_gpusnap.signals.base import SignalSource
from jupyterhub_gpusnap.store import Store
from jupyterhub_gpusnap.watcher import Watcher
from tests.helpers.realhub import RealHub, free_port

log = logging.getLogger("scale")

# ---------------------------------------------------------------- simulated signals


class SimulatedSource(SignalSource):
    """Deterministic samples without I/O: half the servers busy, ~1 % flipping each round.

    A round advances once per tick (through the watcher's ``prefetch`` hook), so a run is
    reproducible: server ``k`` in round ``r`` always gets the same sample.
    """

    name = "simulated"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.round = 0
        self.reads = 0

    async def prefetch(self, servers: list[Server]) -> None:
        self.round += 1

    async def read(self, server: Server, now: float) -> Sample:
        self.reads += 1
        key = server.key
        h = zlib.crc32(key.encode())
        flip = zlib.crc32(f"{key}:{self.round}".encode()) % 100 == 0
        busy = (h % 2 == 0) != flip
        return Sample(
            time=now,
            kernels=1 + h % 3,
            kernels_busy=0,
            terminals=h % 2,
            cpu_percent=55.0 if busy else 0.5,
            gpu_percent=80.0 if busy and h % 4 == 0 else 0.0,
            gpu_memory_bytes=(h % 8) << 30,
            gpu_count=1,
        )


def bench_policy() -> Policy:
    """Idle windows so long that no server is ever warned or stopped during the bench."""
    rule = Rule(name="bench", idle_window=365 * 86400.0, warn_before=900.0, min_running=600.0)
    return Policy(rules=[], default=rule)


# ---------------------------------------------------------------- counting Hub requests


class RequestCounter:
    """Counts every HTTP request this process makes with tornado's client (ours and the culler's)."""

    def __init__(self):
        self.count = 0
        self._orig = SimpleAsyncHTTPClient.fetch_impl

    def __enter__(self) -> RequestCounter:
        orig = self._orig

        def counting(client, request, callback):
            self.count += 1
            return orig(client, request, callback)

        SimpleAsyncHTTPClient.fetch_impl = counting
        return self

    def __exit__(self, *exc) -> None:
        SimpleAsyncHTTPClient.fetch_impl = self._orig


# ---------------------------------------------------------------- the population


def hub_config(standin_url: str, page_max: int) -> str:
    return f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
c.JupyterHub.spawner_class = "bench.standin_spawner.StandinSpawner"
c.StandinSpawner.target_url = {standin_url!r}
c.Spawner.poll_interval = 86400
c.Spawner.http_timeout = 120
c.Spawner.start_timeout = 120
c.JupyterHub.log_level = "WARN"
c.JupyterHub.concurrent_spawn_limit = 0
c.JupyterHub.active_server_limit = 0
c.JupyterHub.api_page_default_limit = 200
c.JupyterHub.api_page_max_limit = {page_max}
c.JupyterHub.last_activity_interval = 86400
c.JupyterHub.proxy_check_interval = 86400
c.JupyterHub.service_check_interval = 86400
c.JupyterHub.init_spawners_timeout = -1
"""


class Population:
    """A real Hub with stand-in servers named ``u00000``…; grown with :meth:`grow`, reusable.

    ``root`` keeps the Hub's database and the stand-in server's port across runs.
    """

    def __init__(self, root: Path, page_max: int):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.meta_file = root / "population.json"
        meta = json.loads(self.meta_file.read_text()) if self.meta_file.exists() else {}
        self.port = meta.get("standin_port") or free_port()
        self.servers = meta.get("servers", 0)
        self.page_max = page_max
        self.standin: asyncio.subprocess.Process | None = None
        self.hub: RealHub | None = None

    def save(self) -> None:
        self.meta_file.write_text(json.dumps({"standin_port": self.port, "servers": self.servers}))

    async def start(self) -> float:
        """Start the stand-in server and the Hub (restoring a cached population); seconds taken."""
        t0 = time.perf_counter()
        self.standin = await asyncio.create_subprocess_exec(
            sys.executable,
            str(ROOT / "bench" / "standin_spawner.py"),
            "--port",
            str(self.port),
            stdout=asyncio.subprocess.DEVNULL,
            cwd=str(self.root),
        )
        self.hub = RealHub(
            self.root / "hub",
            hub_config(f"http://127.0.0.1:{self.port}", self.page_max),
            start_timeout=1200,
        )
        await self.hub._wait_port(self.port, "stand-in server", self.root / "population.json")
        await self.hub.start()
        if self.servers:
            await self.wait_ready(self.servers)
        return time.perf_counter() - t0

    async def ready_count(self) -> int:
        resp = await self.hub.client.fetch(
            HTTPRequest(
                self.hub.hub_api_url + "/users?state=ready&limit=1",
                request_timeout=300,
                headers={
                    "Authorization": f"token {self.hub.admin_token}",
                    "Accept": "application/jupyterhub-pagination+json",
                },
            )
        )
        return json.loads(resp.body)["_pagination"]["total"]

    async def wait_ready(self, n: int, timeout: float = 1800) -> None:
        deadline = time.monotonic() + timeout
        while (have := await self.ready_count()) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {have} of {n} servers ready:\n{self.hub.log_tail()}")
            await asyncio.sleep(1)

    async def ready_names(self) -> set[str]:
        """Names of users whose server is ready (every page of ``GET /users?state=ready``)."""
        names: set[str] = set()
        offset = 0
        while True:
            resp = await self.hub.client.fetch(
                HTTPRequest(
                    self.hub.hub_api_url + f"/users?state=ready&limit=200&offset={offset}",
                    request_timeout=300,
                    headers={
                        "Authorization": f"token {self.hub.admin_token}",
                        "Accept": "application/jupyterhub-pagination+json",
                    },
                )
            )
            page = json.loads(resp.body)
            names.update(u["name"] for u in page["items"])
            if not page["_pagination"]["next"] or not page["items"]:
                return names
            offset = page["_pagination"]["next"]["offset"]

    async def grow(self, n: int, batch: int = 500, concurrency: int = 10) -> float:
        """Create users and spawn servers until ``n`` are running; seconds taken.

        Resumable: users that exist are kept and servers already running are not spawned
        again, so an interrupted population is completed by the next run.
        """
        t0 = time.perf_counter()
        self.save()  # the stand-in port, before any server points at it
        names = [f"u{i:05d}" for i in range(self.servers, n)]
        for i in range(0, len(names), batch):
            status, data = await self.hub.api(
                "POST", "/users", {"usernames": names[i : i + batch]}, timeout=600
            )
            if status not in (201, 409):
                raise RuntimeError(f"creating users: {status} {data}")
        ready = await self.ready_names() if self.servers < n else set()
        names = [u for u in names if u not in ready]
        sem = asyncio.Semaphore(concurrency)  # the harness's HTTP client runs 10 at once

        async def spawn(name: str) -> None:
            async with sem:
                status, data = await self.hub.api("POST", f"/users/{name}/server", {}, timeout=600)
                if status not in (201, 202) and "already" not in str(data):
                    raise RuntimeError(f"spawning {name}: {status} {data}")

        done = 0
        for i in range(0, len(names), 1000):
            await asyncio.gather(*(spawn(u) for u in names[i : i + 1000]))
            done += len(names[i : i + 1000])
            print(f"  spawned {done}/{len(names)} ({time.perf_counter() - t0:.0f}s)", flush=True)
        await self.wait_ready(n)
        self.servers = n
        self.save()
        return time.perf_counter() - t0

    async def stop(self) -> None:
        """Stop the Hub (servers stay 'running' in its database for the next run) and the stand-in."""
        if self.hub is not None:
            await self.hub._terminate(self.hub.hub_proc, timeout=120)
            await self.hub._terminate(self.hub.proxy_proc)
            self.hub.client.close()
        if self.standin is not None and self.standin.returncode is None:
            self.standin.terminate()
            await self.standin.wait()


# ---------------------------------------------------------------- measurements


def make_watcher(
    hub: RealHub, db: Path, page_size: int
) -> tuple[Watcher, HubClient, SimulatedSource]:
    client = HubClient(api_url=hub.hub_api_url, api_token=hub.admin_token, page_size=page_size)
    source = SimulatedSource()
    watcher = Watcher(
        hub=client,
        store=Store(f"sqlite:///{db}"),
        policy=bench_policy(),
        sources=[source],
        backend=None,
    )
    return watcher, client, source


async def measure_tick(watcher: Watcher, client: HubClient, counter: RequestCounter) -> dict:
    r0, c0 = client.requests, counter.count
    w0, p0 = time.perf_counter(), time.process_time()
    await watcher.tick()
    cpu, wall = time.process_time() - p0, time.perf_counter() - w0
    return {
        "cpu_s": cpu,
        "wall_s": wall,
        "requests": client.requests - r0,
        "http_requests": counter.count - c0,
        "servers": len(watcher.servers),
        "decisions": len(watcher.decisions),
    }


async def measure_culler(hub: RealHub, page_size: int, counter: RequestCounter) -> dict:
    from jupyterhub_idle_culler import cull_idle

    culler_log = logging.getLogger("idle-culler")
    c0 = counter.count
    w0, p0 = time.perf_counter(), time.process_time()
    await cull_idle(
        url=hub.hub_api_url,
        api_token=hub.admin_token,
        inactive_limit=10**9,
        logger=culler_log,
        concurrency=10,
        api_page_size=page_size,
    )
    cpu, wall = time.process_time() - p0, time.perf_counter() - w0
    return {"cpu_s": cpu, "wall_s": wall, "http_requests": counter.count - c0}


async def profiled_tick(watcher: Watcher, top: int = 30) -> str:
    prof = cProfile.Profile()
    prof.enable()
    await watcher.tick()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


async def memory_run(
    hub: RealHub, db: Path, page_size: int, ticks: int, every: int = 100
) -> list[dict]:
    """RSS and tracemalloc's traced size every ``every`` ticks over ``ticks`` ticks."""
    watcher, client, _ = make_watcher(hub, db, page_size)
    proc = psutil.Process()
    rows = []
    tracemalloc.start()
    try:
        for i in range(1, ticks + 1):
            await watcher.tick()
            if i == 1 or i % every == 0:
                gc.collect()
                current, _peak = tracemalloc.get_traced_memory()
                rows.append(
                    {
                        "tick": i,
                        "rss_mib": proc.memory_info().rss / 2**20,
                        "traced_mib": current / 2**20,
                        "requests": client.requests,
                    }
                )
                print(
                    f"  memory: tick {i}: rss {rows[-1]['rss_mib']:.1f} MiB, traced {rows[-1]['traced_mib']:.2f} MiB",
                    flush=True,
                )
    finally:
        tracemalloc.stop()
        watcher.store.close()
    return rows


def memory_check(
    rows: list[dict], traced_limit_mib: float = 0.5, rss_limit_mib: float = 8.0
) -> dict:
    """Whether memory stayed flat: growth from the first sample after warm-up to the last.

    Warm-up is the first 100 ticks (caches, metric children, SQLite's page cache fill
    then); after it, ``tracemalloc``'s traced size (Python objects) may grow by at most
    ``traced_limit_mib`` and RSS by at most ``rss_limit_mib`` over the remaining ticks.
    """
    after = [r for r in rows if r["tick"] >= 100] or rows
    if len(after) < 2:
        return {"flat": None, "why": "too few samples (run with --memory-ticks 200 or more)"}
    first, last = after[0], after[-1]
    traced = last["traced_mib"] - first["traced_mib"]
    rss = last["rss_mib"] - first["rss_mib"]
    return {
        "from_tick": first["tick"],
        "to_tick": last["tick"],
        "traced_growth_mib": round(traced, 3),
        "rss_growth_mib": round(rss, 3),
        "traced_limit_mib": traced_limit_mib,
        "rss_limit_mib": rss_limit_mib,
        "flat": traced <= traced_limit_mib and rss <= rss_limit_mib,
    }


def summarize(ticks: list[dict]) -> dict:
    return {
        k: statistics.median(t[k] for t in ticks)
        for k in ("cpu_s", "wall_s", "requests", "http_requests")
    }


async def populated(cache: Path, servers: int, page_max: int, setup: dict, tag: str) -> Population:
    """A started Hub holding ``servers`` stand-in servers (from the cache where it can)."""
    pop = Population(cache / f"scale-{servers}", page_max=page_max)
    setup[f"{tag}hub_start_s"] = await pop.start()
    setup[f"{tag}cached_servers"] = pop.servers
    if pop.servers < servers:
        setup[f"{tag}populate_s"] = await pop.grow(servers)
    print(f"population: {pop.servers} servers ready; setup {json.dumps(setup)}", flush=True)
    return pop


async def run(args: argparse.Namespace) -> dict:
    cache = Path(args.cache).expanduser()
    page_max = max(args.page_size, 200)
    setup: dict = {}
    work = Path(tempfile.mkdtemp(prefix="gpusnap-scale-"))
    memory: list[dict] = []
    if args.memory_ticks:
        # a Hub of its own: a tick's wall time is mostly the Hub's, so fewer servers here
        pop = await populated(cache, args.memory_servers, page_max, setup, "memory_")
        try:
            print(f"memory: {args.memory_ticks} ticks over {pop.servers} servers", flush=True)
            t0 = time.perf_counter()
            memory = await memory_run(
                pop.hub, work / "memory.sqlite", args.page_size, args.memory_ticks
            )
            setup["memory_run_s"] = time.perf_counter() - t0
        finally:
            await pop.stop()
    counter = RequestCounter()
    counter.__enter__()
    pop = None
    try:
        pop = await populated(cache, args.servers, page_max, setup, "")
        hub = pop.hub
        watcher, client, source = make_watcher(hub, work / "gpusnap.sqlite", args.page_size)
        ours = []
        for i in range(args.ticks):
            row = await measure_tick(watcher, client, counter)
            row["tick"] = i + 1
            ours.append(row)
            print(f"  gpusnap tick {i + 1}: {row}", flush=True)
        culler = []
        for i in range(args.ticks):
            row = await measure_culler(hub, args.page_size, counter)
            culler.append(row)
            print(f"  idle-culler run {i + 1}: {row}", flush=True)
        profile = await profiled_tick(watcher) if args.profile else ""
        if profile:
            print(profile)
        counts = watcher.store.counts_by_state()
        events = len(watcher.store.events(limit=10**7))
        watcher.store.close()
    finally:
        counter.__exit__()
        if pop is not None:
            await pop.stop()
    steady = ours[1:] or ours
    return {
        "ours": ours,
        "culler": culler,
        "steady": summarize(steady),
        "first": ours[0],
        "culler_median": summarize([{**c, "requests": c["http_requests"]} for c in culler]),
        "memory": memory,
        "setup": setup,
        "profile": profile,
        "states": counts,
        "events": events,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", type=int, default=10000, help="running servers in the Hub")
    p.add_argument(
        "--page-size",
        type=int,
        default=200,
        help="users per GET /users page (HubClient.page_size; the Hub's api_page_max_limit is raised to match)",
    )
    p.add_argument(
        "--ticks", type=int, default=5, help="ticks measured (the first has a fresh database)"
    )
    p.add_argument(
        "--memory-ticks", type=int, default=1000, help="ticks of the memory run (0: skip)"
    )
    p.add_argument(
        "--memory-servers", type=int, default=200, help="servers in the memory run's own Hub"
    )
    p.add_argument(
        "--cache",
        default=os.environ.get("GPUSNAP_BENCH_CACHE", "~/.cache/gpusnap-bench"),
        help="folder keeping the Hub's database between runs",
    )
    p.add_argument("--profile", action="store_true", help="print a cProfile of one more tick")
    p.add_argument(
        "--memory-from",
        default="",
        help="take the memory run from this earlier scale.json (run with the same code) "
        "instead of running it again; its creation time is recorded",
    )
    p.add_argument("--label", default="", help="a note stored with the results (e.g. 'before')")
    p.add_argument(
        "--before",
        default="",
        help="an earlier scale.json (e.g. of the code before a change, run just before this one) "
        "whose tick figures are printed and stored beside this run's as 'before'",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    earlier = None
    if args.memory_from:
        earlier = json.loads(Path(args.memory_from).read_text())
        args.memory_ticks = 0
    load_before = os.getloadavg()
    res = asyncio.run(run(args))
    res["setup"]["load_average"] = {"start": load_before, "end": os.getloadavg()}
    if earlier is not None:
        res["memory"] = earlier["memory"]
        for key in (
            "memory_hub_start_s",
            "memory_cached_servers",
            "memory_populate_s",
            "memory_run_s",
        ):
            if key in earlier.get("setup", {}):
                res["setup"][key] = earlier["setup"][key]
        res["setup"]["memory_from"] = {"created": earlier["created"], "label": earlier.get("label")}
        args.memory_ticks = earlier["settings"]["memory_ticks"]
        args.memory_servers = earlier["settings"]["memory_servers"]
    s, c, f = res["steady"], res["culler_median"], res["first"]
    rows = [
        {
            "what": "gpusnap tick (first, fresh db)",
            "servers": f["servers"],
            "cpu_s": f["cpu_s"],
            "wall_s": f["wall_s"],
            "hub_requests": f["requests"],
        },
        {
            "what": "gpusnap tick (steady, median)",
            "servers": f["servers"],
            "cpu_s": s["cpu_s"],
            "wall_s": s["wall_s"],
            "hub_requests": s["requests"],
        },
        {
            "what": "idle-culler cull_idle (median)",
            "servers": f["servers"],
            "cpu_s": c["cpu_s"],
            "wall_s": c["wall_s"],
            "hub_requests": c["http_requests"],
        },
    ]
    print_table(rows, ["what", "servers", "cpu_s", "wall_s", "hub_requests"])
    before = None
    if args.before:
        old = json.loads(Path(args.before).read_text())
        before = {"created": old["created"], "label": old.get("label"), "rows": old["rows"]}
        both = [
            {
                "what": f"{r['what']}: {when}",
                "cpu_s": r["cpu_s"],
                "wall_s": r["wall_s"],
                "hub_requests": r["hub_requests"],
            }  # fmt: skip
            for r0, r1 in zip(old["rows"], rows, strict=True)
            for when, r in (("before", r0), ("after", r1))
        ]
        print_table(both, ["what", "cpu_s", "wall_s", "hub_requests"])
    check = memory_check(res["memory"]) if res["memory"] else None
    if res["memory"]:
        print_table(res["memory"], ["tick", "rss_mib", "traced_mib", "requests"])
        verdict = {True: "FLAT", False: "GROWING", None: "unknown"}[check["flat"]]
        print(
            f"memory {verdict}: ticks {check.get('from_tick')}-{check.get('to_tick')}: "
            f"traced {check.get('traced_growth_mib')} MiB (limit {check.get('traced_limit_mib')}), "
            f"rss {check.get('rss_growth_mib')} MiB (limit {check.get('rss_limit_mib')})"
        )
    write_json(
        "scale",
        rows,
        label=args.label,
        settings={
            "servers": args.servers,
            "page_size": args.page_size,
            "ticks": args.ticks,
            "memory_ticks": args.memory_ticks,
            "memory_servers": args.memory_servers if args.memory_ticks else None,
            "hub_api_page_max_limit": max(args.page_size, 200),
            "culler_concurrency": 10,
            "signal_source": "SimulatedSource (no I/O)",
            "store": "SQLite file",
        },
        ticks=res["ours"],
        culler=res["culler"],
        memory=res["memory"],
        memory_check=check,
        before=before,
        setup=res["setup"],
        states=res["states"],
        events=res["events"],
    )


if __name__ == "__main__":
    main()
