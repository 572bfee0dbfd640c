"""The scale benchmark's machinery, small: 50 stand-in servers in a real JupyterHub.

What ``bench/scale.py`` measures at 10,000 servers is checked here for correctness
only (never timing): a tick lists servers with one Hub request per page, every server
gets a decision from the simulated signals, the database holds one row per server,
and jupyterhub-idle-culler on the same Hub culls nothing with a huge timeout.
"""

from __future__ import annotations

import math
import zlib

import pytest
import scale  # noqa: E402  (bench/scale.py)

from jupyterhub_gpusnap.gpu.cuda import CudaCheckpoint  # noqa: E402
from jupyterhub_gpusnap.gpu.nvml import Nvml  # noqa: E402
from jupyterhub_gpusnap.model import State  # noqa: E402
from tests.helpers.fake_gpu import FakeLibcuda, SharedGpus, U
from tests.helpers.metrics import metric

pytestmark = pytest.mark.e2e

N = 50
PAGE = 7


def expected_state(key: str, round_: int) -> State:
    """What SimulatedSource makes of ``key`` in ``round_``: busy -> active, quiet -> idle."""
    busy = zlib.crc32(key.encode()) % 2 == 0
    flip = zlib.crc32(f"{key}:{round_}".encode()) % 100 == 0
    # quiet servers younger than min_running stay 'idle' with no action
    return State.active if busy != flip else State.idle


@pytest.fixture
async def population(tmp_path):
    pop = scale.Population(tmp_path / "pop", page_max=200)
    try:
        await pop.start()
        await pop.grow(N, batch=20, concurrency=10)
        yield pop
    finally:
        await pop.stop()
        if pop.hub is not None:
            pop.hub.kill_leftovers()


async def test_tick_is_paginated_and_decides_every_server(population, tmp_path):
    hub = population.hub
    assert await population.ready_count() == N
    watcher, client, source = scale.make_watcher(hub, tmp_path / "gpusnap.sqlite", PAGE)
    keys = {f"u{i:05d}/" for i in range(N)}
    pages = math.ceil(N / PAGE)
    with scale.RequestCounter() as counter:
        for round_ in (1, 2):
            row = await scale.measure_tick(watcher, client, counter)
            assert row["requests"] == pages  # O(pages), not O(servers)
            assert row["http_requests"] == pages  # the simulated source makes no requests
            assert row["servers"] == N and row["decisions"] == N
            assert source.reads == N * round_
            assert set(watcher.decisions) == keys
            for key, decision in watcher.decisions.items():
                assert decision.state == expected_state(key, round_), key
                assert decision.action is None  # nobody is warned or stopped
            stored = {s.key: s for s in watcher.store.all()}
            assert set(stored) == keys  # one row per server, written by the batch
            assert all(stored[k].state == expected_state(k, round_) for k in keys)
        # one 'state' event per server that changed state (new ones start active)
        changes = sum(expected_state(k, 1) != State.active for k in keys)
        changes += sum(expected_state(k, 1) != expected_state(k, 2) for k in keys)
        assert len(watcher.store.events(limit=1000)) == changes
        watcher.store.close()

        culled = await scale.measure_culler(hub, PAGE, counter)
    assert culled["http_requests"] == 1 + pages  # GET / for the version, then the pages
    assert await population.ready_count() == N  # a huge timeout culls nothing

    # with a page as large as the Hub allows, a tick over 50 servers is one request
    watcher, client, _ = scale.make_watcher(hub, tmp_path / "large-page.sqlite", 200)
    await watcher.tick()
    assert client.requests == 1
    assert set(watcher.decisions) == keys

    # min_free_gpu_memory is checked every tick: a GPU short of memory (held by a process
    # that is no server's; the stand-ins hold none) is reported, and nothing is parked
    driver = FakeLibcuda([])
    gpus = SharedGpus(
        driver, [{"name": "NVIDIA H100", "procs": {}, "other": 78 * U, "samples": [], "util": 0}]
    )
    watcher.room._cuda = CudaCheckpoint(driver=driver, nvml=Nvml(gpus), log=watcher.log)
    watcher.min_free_gpu_memory = 4 * U
    short = metric("gpusnap_make_room_total", trigger="min_free_gpu_memory", result="short")
    await watcher.tick()
    assert metric("gpusnap_gpu_free_bytes", node="", gpu="0") == 2 * U
    assert (
        metric("gpusnap_make_room_total", trigger="min_free_gpu_memory", result="short")
        == short + 1
    )
    assert driver.calls == []  # no server held memory on it: nothing to park
    assert State.parked not in {s.state for s in watcher.store.all()}
    watcher.store.close()
