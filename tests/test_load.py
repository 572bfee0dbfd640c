"""Load: 500 servers go idle at once in a real JupyterHub.

The Hub is real (with configurable-http-proxy) and holds 500 running stand-in servers
(``bench/standin_spawner.py``: one shared HTTP server answers for all of them). The
watcher is the service's own, with its real Hub client; its checkpoint backend is
:class:`RecordingBackend`, a real :class:`CheckpointBackend` that saves nothing: it
records when each checkpoint starts and ends and how many run at once, and holds the
first ones until the test lets them go. Every suspension then stops its server through
the Hub API, as in production.

Shown: suspensions run at ``Watcher.suspend_concurrency`` at most (and reach it), the Hub
API answers and the watcher keeps ticking while they run, every one of the 500 servers
is taken on by the tick that found it idle and suspended exactly once (none starves),
and they are taken on oldest-idle first.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import time
from collections import Counter

import pytest
import scale  # noqa: E402  (bench/scale.py: the stand-in population)
from tornado.httpclient import AsyncHTTPClient, HTTPRequest

from jupyterhub_gpusnap.checkpoint.base import CheckpointBackend, CheckpointInfo  # noqa: E402
from jupyterhub_gpusnap.hub import HubClient  # noqa: E402
from jupyterhub_gpusnap.model import Sample, Server  # noqa: E402
from jupyterhub_gpusnap.policy import Policy, Rule  # noqa: E402
from jupyterhub_gpusnap.signals.base import SignalSource  # noqa: E402
from jupyterhub_gpusnap.store import Store  # noqa: E402
from jupyterhub_gpusnap.watcher import Watcher  # noqa: E402

pytestmark = pytest.mark.e2e

N = 500
CONCURRENCY = 8
IDLE_WINDOW = 3600.0


class RecordingBackend(CheckpointBackend):
    """A checkpoint backend that writes nothing: it records, waits for ``gate``, then sleeps.

    ``started`` lists server keys in the order their checkpoints began; ``running`` and
    ``max_running`` count checkpoints under way.
    """

    def __init__(self, gate: asyncio.Event, seconds: float = 0.005, **kwargs):
        super().__init__(**kwargs)
        self.gate = gate
        self.seconds = seconds
        self.started: list[str] = []
        self.finished: list[str] = []
        self.running = 0
        self.max_running = 0
        self.infos: dict[str, CheckpointInfo] = {}

    async def checkpoint(self, server: Server) -> CheckpointInfo:
        self.started.append(server.key)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await self.gate.wait()
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
        self.finished.append(server.key)
        return info

    async def latest(self, user: str, server_name: str) -> CheckpointInfo | None:
        found = [i for i in self.infos.values() if (i.user, i.server_name) == (user, server_name)]
        return max(found, key=lambda i: i.created) if found else None

    async def list(self, user: str | None = None) -> list[CheckpointInfo]:
        found = [i for i in self.infos.values() if user is None or i.user == user]
        return sorted(found, key=lambda i: i.created, reverse=True)

    async def delete(self, checkpoint_id: str) -> None:
        self.infos.pop(checkpoint_id, None)


class QuietSource(SignalSource):
    """Jupyter-like samples without I/O: no kernel busy, no CPU or GPU use, and each
    server's last kernel activity at the time given in ``last_activity``."""

    name = "jupyter"

    def __init__(self, last_activity: dict[str, float], **kwargs):
        super().__init__(**kwargs)
        self.last_activity = last_activity

    async def read(self, server: Server, now: float) -> Sample:
        return Sample(
            time=now,
            kernels=1,
            kernels_busy=0,
            terminals=0,
            jupyter_last_activity=self.last_activity[server.key],
            cpu_percent=0.0,
            gpu_percent=0.0,
        )


@pytest.fixture
async def population(tmp_path):
    """A real Hub with N running stand-in servers. Its folder (its SQLite database) is on a
    tmpfs: the Hub commits thousands of times while spawning and stopping 500 servers, and
    each commit's fsync on a real disk would make most of this test's time."""
    root = tmp_path / "pop"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(root)], check=True)
    pop = scale.Population(root, page_max=200)
    try:
        await pop.start()
        await pop.grow(N, batch=N, concurrency=10)
        yield pop
    finally:
        await pop.stop()
        if pop.hub is not None:
            pop.hub.kill_leftovers()
        if subprocess.run(["umount", str(root)]).returncode != 0:
            subprocess.run(["umount", "--lazy", str(root)], check=True)


async def hub_answers(hub, user: str) -> int:
    """One Hub API request (a user's model), as a page or another service makes it."""
    req = HTTPRequest(
        f"{hub.hub_api_url}/users/{user}",
        headers={"Authorization": f"token {hub.admin_token}"},
        request_timeout=60,
    )
    resp = await AsyncHTTPClient().fetch(req, raise_error=False)
    return resp.code


async def test_500_idle_servers_are_suspended_in_bounded_oldest_first_order(population, tmp_path):
    hub = population.hub
    assert await population.ready_count() == N
    keys = [f"u{i:05d}/" for i in range(N)]
    # everyone was last active at a different time, in an order unrelated to their names
    ranks = list(range(N))
    random.Random(9).shuffle(ranks)
    t0 = time.time() + 10
    activity = {key: t0 + rank for key, rank in zip(keys, ranks, strict=True)}
    oldest_first = sorted(keys, key=activity.__getitem__)

    clock = [t0 + N + 60]
    gate = asyncio.Event()
    backend = RecordingBackend(gate)
    rule = Rule(name="load", idle_window=IDLE_WINDOW, warn_before=0, min_running=0)
    watcher = Watcher(
        hub=HubClient(api_url=hub.hub_api_url, api_token=hub.admin_token, page_size=200),
        store=Store(f"sqlite:///{tmp_path / 'gpusnap.sqlite'}"),
        policy=Policy(rules=[], default=rule),
        sources=[QuietSource(activity)],
        backend=backend,
        clock=lambda: clock[0],
        suspend_concurrency=CONCURRENCY,
    )
    try:
        # tick 1: every server was active a moment ago
        await watcher.tick()
        assert watcher.store.counts_by_state().get("active") == N
        assert backend.started == []

        # tick 2: all 500 have been idle longer than the idle window, at the same moment
        clock[0] += IDLE_WINDOW + N
        await watcher.tick()
        # none is left for a later tick: all are taken on (queued or under way) now
        assert watcher.store.counts_by_state().get("suspending") == N
        while len(backend.started) < CONCURRENCY:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # room for a suspension beyond the limit to (wrongly) start
        assert backend.running == CONCURRENCY and len(backend.started) == CONCURRENCY

        # while they run: the Hub answers, and the watcher goes on ticking without taking
        # any server on twice
        for key in (keys[0], oldest_first[-1]):
            assert await hub_answers(hub, key.rstrip("/")) == 200
        clock[0] += 60
        await watcher.tick()
        assert len(watcher.servers) == N  # nothing stopped yet: every checkpoint is held

        codes: list[int] = []
        polling = True

        async def poll_hub() -> None:
            i = 0
            while polling:
                codes.append(await hub_answers(hub, keys[i % N].rstrip("/")))
                i += 1
                await asyncio.sleep(0.05)

        poller = asyncio.ensure_future(poll_hub())
        gate.set()
        while len(backend.finished) < N // 2:
            await asyncio.sleep(0.05)
        clock[0] += 60
        await watcher.tick()  # a tick in the middle of it all lists the servers left
        assert 0 < len(watcher.servers) < N
        await watcher.wait_idle()
        polling = False
        await poller
        assert codes and set(codes) == {200}, Counter(codes)

        # every server suspended exactly once, never more than CONCURRENCY at a time
        assert Counter(backend.started) == Counter(keys)
        assert backend.max_running == CONCURRENCY
        assert watcher.store.counts_by_state().get("suspended") == N
        assert await population.ready_count() == 0  # all stopped through the Hub API
        # nothing lost: each server's record names the verified checkpoint its suspension made
        for status in watcher.store.all():
            info = backend.infos.get(status.checkpoint_id)
            assert info is not None and info.key == status.key and info.status == "verified", status
        suspends = [e for e in watcher.store.events(None, limit=10 * N) if e["kind"] == "suspend"]
        assert Counter(e["key"] for e in suspends) == Counter(keys)
        # oldest idle first
        assert backend.started == oldest_first
    finally:
        gate.set()
        await watcher.wait_idle()
        watcher.store.close()
