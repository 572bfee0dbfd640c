"""SignalSource.sample: the time limit and failure handling every source gets.

Real sources stand in for slow, broken and fast ones: subclasses of SignalSource whose
read() awaits a real asyncio sleep or raises, as a real Jupyter or Prometheus read would.
"""

from __future__ import annotations

import asyncio

import pytest

from jupyterhub_gpusnap.model import Sample, Server
from jupyterhub_gpusnap.signals.base import SignalSource


class Slow(SignalSource):
    """Answers after ``delays[user]`` seconds (forever when None); raises for user 'broken'."""

    name = "slow"

    def __init__(self, delays: dict[str, float | None], **kwargs):
        super().__init__(**kwargs)
        self.delays = delays
        self.cleaned_up: list[str] = []

    async def read(self, server: Server, now: float) -> Sample:
        if server.user == "broken":
            raise RuntimeError("no route to the server")
        delay = self.delays.get(server.user, 0)
        try:
            if delay is None:
                await asyncio.Event().wait()
            elif delay:
                await asyncio.sleep(delay)
        finally:
            self.cleaned_up.append(server.user)  # a cancelled read still runs its cleanup
        return Sample(time=now, kernels=1, kernels_busy=0)


async def test_a_read_past_the_timeout_says_nothing_and_the_rest_answer():
    source = Slow({"hung": None, "quick": 0, "soon": 0.01}, timeout=0.3, concurrency=3)
    users = ["hung", "quick", "broken", "soon", "hung", "quick"]
    reads = asyncio.gather(*(source.sample(Server(user=u), now=1.0) for u in users))
    samples = await asyncio.wait_for(reads, 30)  # a hang here is the failure, not a wait
    by_user = list(zip(users, samples, strict=True))
    for user, sample in by_user:
        assert sample.time == 1.0
        if user == "hung":
            assert sample.errors == {"slow": "no answer within 0.3s"} and sample.kernels is None
        elif user == "broken":
            assert sample.errors == {"slow": "RuntimeError: no route to the server"}
        else:
            assert sample.errors == {} and sample.kernels == 1
    assert source.cleaned_up.count("hung") == 2
    # the timed-out reads left their tasks usable: this task is not marked as cancelled
    assert asyncio.current_task().cancelling() == 0
    assert (await source.sample(Server(user="quick"), now=2.0)).kernels == 1


async def test_one_task_reads_many_servers_in_turn_each_with_its_own_limit():
    """As the watcher's workers do: one task, one read after another."""
    source = Slow({"hung": None, "soon": 0.05}, timeout=0.2)

    async def in_turn() -> list[Sample]:
        got = [
            await source.sample(Server(user=u), now=1.0)
            for u in ["soon", "hung", "soon", "hung", "soon"]
        ]
        assert asyncio.current_task().cancelling() == 0
        return got

    got = await asyncio.wait_for(in_turn(), 30)  # a hang here is the failure, not a wait
    assert [bool(s.errors) for s in got] == [False, True, False, True, False]


async def test_cancelling_the_caller_is_not_mistaken_for_a_timeout():
    source = Slow({"hung": None}, timeout=60)
    task = asyncio.ensure_future(source.sample(Server(user="hung")))
    await asyncio.sleep(0.05)
    task.cancel()  # e.g. the service shutting down mid-tick
    with pytest.raises(asyncio.CancelledError):
        await task
    assert source.cleaned_up == ["hung"]
