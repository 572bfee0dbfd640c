"""The contract every signal source follows."""

from __future__ import annotations

import asyncio
import time

from traitlets import Float, Integer
from traitlets.config import LoggingConfigurable

from ..model import Sample, Server


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
        now = time.time() if now is None else now
        async with self._semaphore:
            try:
                return await asyncio.wait_for(self.read(server, now), self.timeout)
            except asyncio.TimeoutError:
                why = f"no answer within {self.timeout:g}s"
            except Exception as e:  # a broken source says nothing, the tick goes on
                why = f"{type(e).__name__}: {e}"
        self.log.debug("signal %s for %s: %s", self.name, server.key, why)
        return Sample(time=now, errors={self.name: why})
