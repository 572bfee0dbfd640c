"""LocalProcessSignal against real process trees.

A busy loop's share of a core depends on what else the machine runs, so the
busy cases compare the reading with the CPU seconds the busy process itself
used between the two readings, measured independently: the tree's reading can
never be lower than that, and is far lower when the process is not counted.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from jupyterhub_gpusnap.model import Sample, Server
from jupyterhub_gpusnap.signals.local import LocalProcessSignal, tree_cpu_seconds

BUSY = "import time\nend = time.time() + 60\nwhile time.time() < end: pass\n"
SLEEP = "import time\ntime.sleep(60)\n"
SLEEP_TREE = "sleep 60 & sleep 60; wait"  # a shell with two sleeping children, nearly no CPU
TICK = 0.02  # /proc reports CPU time in 1/100 s


def boost() -> None:
    """Run the tree at nice -10 so that a busy loop gets most of a core on a loaded machine."""
    os.setpriority(os.PRIO_PROCESS, 0, -10)


def spawn(code: str) -> subprocess.Popen:
    if code == SLEEP_TREE:
        return subprocess.Popen(["sh", "-c", code], start_new_session=True)
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True, preexec_fn=boost)


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []

    def start(code: str) -> subprocess.Popen:
        proc = spawn(code)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        stop(proc)


def server_for(pid: int, user: str = "alice") -> Server:
    return Server(user=user, url=f"/user/{user}/", state={"pid": pid})


def own_cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def descendants(pid: int, count: int) -> list[psutil.Process]:
    for _ in range(200):
        found = psutil.Process(pid).children(recursive=True)
        if len(found) >= count:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"process {pid} did not start {count} descendants")


async def readings_with_leaf(
    source: LocalProcessSignal, server: Server, leaf: int
) -> tuple[Sample, Sample, float]:
    """Two readings 1 s apart, and the least percent the tree must read given ``leaf``'s use."""
    started = time.monotonic()
    first = await source.sample(server)
    leaf_before = own_cpu(leaf)
    await asyncio.sleep(1.0)
    leaf_used = own_cpu(leaf) - leaf_before
    second = await source.sample(server)
    window = time.monotonic() - started  # longer than the source's own window
    assert leaf_used > 0.1, f"the busy loop hardly ran ({leaf_used:.2f}s of CPU in 1s)"
    return first, second, 100.0 * (leaf_used - TICK) / window


async def test_busy_child_reads_busy(procs):
    # a shell-like parent that waits on a child spinning in a loop
    parent = procs(f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {BUSY!r}])\n")
    (child,) = await descendants(parent.pid, 1)
    source = LocalProcessSignal()
    first, second, least = await readings_with_leaf(source, server_for(parent.pid), child.pid)
    assert first.cpu_percent is None and first.errors == {}  # baseline only
    assert second.errors == {}
    assert second.cpu_percent >= least > 10


async def test_sleeping_tree_reads_idle(procs):
    parent = procs(SLEEP_TREE)
    await descendants(parent.pid, 2)
    source = LocalProcessSignal()
    first = await source.sample(server_for(parent.pid))
    await asyncio.sleep(1.0)
    second = await source.sample(server_for(parent.pid))
    assert first.cpu_percent is None
    assert second.errors == {}
    assert second.cpu_percent is not None and second.cpu_percent < 5


async def test_grandchild_busy_under_sleeping_parent_is_counted(procs):
    middle = (
        f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {BUSY!r}])\n"
        f"exec({SLEEP!r})\n"
    )
    parent = procs(
        f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {middle!r}])\n"
        f"exec({SLEEP!r})\n"
    )
    found = await descendants(parent.pid, 2)
    grandchild = next(p for p in found if p.ppid() != parent.pid)
    source = LocalProcessSignal()
    root_before = own_cpu(parent.pid)
    _, second, least = await readings_with_leaf(source, server_for(parent.pid), grandchild.pid)
    assert own_cpu(parent.pid) - root_before < 0.05  # the root itself sleeps
    assert second.cpu_percent >= least > 10


async def test_time_of_exited_children_is_kept(procs):
    # the child burns 0.5 s of CPU and exits; the parent waits for it, then sleeps
    burst = "import time\nwhile time.process_time() < 0.5: pass\n"
    parent = procs(
        "import subprocess, sys, time\n"
        "time.sleep(0.5)\n"
        f"subprocess.run([sys.executable, '-c', {burst!r}])\n"
        f"exec({SLEEP!r})\n"
    )
    source = LocalProcessSignal()
    server = server_for(parent.pid)
    started = time.monotonic()
    first = await source.sample(server)  # before the child exists
    before, _ = tree_cpu_seconds(parent.pid)
    seen = False
    for _ in range(600):  # until the child has come and gone
        await asyncio.sleep(0.05)
        children = psutil.Process(parent.pid).children()
        seen = seen or bool(children)
        if seen and not children:
            break
    second = await source.sample(server)
    window = time.monotonic() - started
    assert first.cpu_percent is None
    after, _ = tree_cpu_seconds(parent.pid)
    assert not psutil.Process(parent.pid).children()
    assert after - before >= 0.5 - TICK  # the child's time, now in the parent's children fields
    assert second.cpu_percent >= 100.0 * (0.5 - TICK) / window


async def test_dead_root_is_an_error_and_forgets_baseline(procs):
    proc = procs(SLEEP)
    source = LocalProcessSignal()
    server = server_for(proc.pid)
    await source.sample(server)
    stop(proc)
    gone = await source.sample(server)
    assert gone.cpu_percent is None
    assert gone.errors == {"cpu": f"ProcessLookupError: process {proc.pid} is gone"}


async def test_missing_pid_names_the_scope():
    sample = await LocalProcessSignal().sample(Server(user="alice", state={}))
    assert sample.cpu_percent is None
    assert "admin:server_state" in sample.errors["cpu"]


async def test_servers_keep_separate_baselines(procs):
    busy = procs(BUSY)
    idle = procs(SLEEP_TREE)
    source = LocalProcessSignal()
    a, b = server_for(busy.pid, "alice"), server_for(idle.pid, "bob")
    await source.sample(b)
    _, busy_reading, least = await readings_with_leaf(source, a, busy.pid)
    assert busy_reading.cpu_percent >= least
    assert (await source.sample(b)).cpu_percent < 5
    # a new root pid for the same server starts a new baseline
    other = procs(SLEEP_TREE)
    assert (await source.sample(server_for(other.pid, "alice"))).cpu_percent is None
