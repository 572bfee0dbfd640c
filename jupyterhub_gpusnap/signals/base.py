"""The contract every signal source follows."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

from traitlets import Float, Integer
from traitlets.config import LoggingConfigurable

from ..model import Sample, Server

_UNCANCEL = hasattr(asyncio.Task, "uncancel")  # Python 3.11+


class _Deadlines:
    """Time limits for many awaits in their own tasks, with one timer for all of them.

    ``asyncio.wait_for`` starts a task per await and ``asyncio.timeout`` arms a timer per
    await; over thousands of servers per tick both cost more than the reads they guard. Here
    each await only records its deadline; one timer, armed for the earliest, cancels the
    awaits still running past theirs (which then raise ``TimeoutError``) and re-arms itself.
    """

    def __init__(self) -> None:
        self._running: dict[int, list] = {}  # id -> [deadline, task, cancelling before, expired]
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self, coro: Coroutine[Any, Any, Sample], seconds: float) -> Sample:
        """Await ``coro`` in the calling task; ``TimeoutError`` when it takes over ``seconds``."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a timer of another (closed) loop never fires here
            self._loop, self._timer = loop, None
        task = asyncio.current_task()
        entry = [loop.time() + seconds, task, task.cancelling(), False]
        self._running[id(entry)] = entry
        if self._timer is None or entry[0] < self._timer_at:
            self._arm(entry[0])
        try:
            result = await coro
        except asyncio.CancelledError:
            if entry[3] and task.uncancel() <= entry[2]:
                raise asyncio.TimeoutError from None  # our cancellation, nobody else's
            raise
        finally:
            self._running.pop(id(entry), None)
        if entry[3]:  # expired, but the read swallowed the cancellation: its answer stands
            task.uncancel()
        return result

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = self._loop.call_at(at, self._expire), at

    def _expire(self) -> None:
        self._timer = None
        now = self._loop.time()
        earliest = None
        for key, entry in list(self._running.items()):
            if entry[0] <= now:
                entry[3] = True
                del self._running[key]
                entry[1].cancel()
            elif earliest is None or entry[0] < earliest:
                earliest = entry[0]
        if earliest is not None:
            self._arm(earliest)


class SignalSource(LoggingConfigurable):
    """Reads one kind of activity (Jupyter, CPU, GPU, …) for servers.

    Subclasses implement :meth:`read`. :meth:`sample` wraps it with the
    source's timeout and concurrency limit and turns any failure into
    ``Sample.errors[name]`` so that one broken source never stops a tick:
    a source that cannot answer says nothing, and "nothing" is never "idle".
    """

    name = "base"

    timeout = Float(
        10.0,
        help="Seconds one reading of this signal may take before it counts as 'no answer'.",
    ).tag(config=True)

    concurrency = Integer(
        20,
        help="How many servers this source reads at the same time.",
    ).tag(config=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._semaphore = asyncio.Semaphore(self.concurrency)
        self._deadlines = _Deadlines()

    async def setup(self) -> None:
        """Open clients or libraries once, before the first tick."""

    async def close(self) -> None:
        """Release what :meth:`setup` opened."""

    async def read(self, server: Server, now: float) -> Sample:
        """Return a Sample with the fields this source knows filled in.

        Parameters
        ----------
        server : Server
            The running server to read.
        now : float
            The tick's time (seconds since the epoch), to stamp the sample with.
        """
        raise NotImplementedError

    async def sample(self, server: Server, now: float | None = None) -> Sample:
        """:meth:`read` within :attr:`timeout`; any failure becomes ``Sample.errors[name]``."""
        now = time.time() if now is None else now
        async with self._semaphore:
            try:
                if _UNCANCEL:  # read() runs in this task, under the source's one deadline timer
                    return await self._deadlines.run(self.read(server, now), self.timeout)
                return await asyncio.wait_for(self.read(server, now), self.timeout)  # Python 3.10
            except asyncio.TimeoutError:
                why = f"no answer within {self.timeout:g}s"
            except Exception as e:  # a broken source says nothing, the tick goes on
                why = f"{type(e).__name__}: {e}"
        self.log.debug("signal %s for %s: %s", self.name, server.key, why)
        return Sample(time=now, errors={self.name: why})
