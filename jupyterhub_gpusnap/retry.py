"""Bounded retries with jittered exponential backoff, for calls that may fail for a moment.

Registry pushes, API-server calls and node-agent calls go over networks with load
balancers, ingress controllers and pods that restart: a 502 or a refused connection now
says little about a second try. :class:`Backoff` retries such a call a bounded number
of times, waiting longer each time (``first_delay`` doubling up to ``max_delay``, each
wait drawn between half and all of it, so that many agents hit by the same outage do
not come back in step). What is worth retrying is the caller's decision (``retryable``):
never a 4xx, which another try would only repeat.

Each client has its own Backoff (``parent`` = the client), so the settings apply to all
(``c.Backoff.attempts``) or to one client: ``c.RegistryClient.Backoff…`` (registry pushes and
pulls, in the agent), ``c.AgentLocator.Backoff…`` (the service's API-server and agent calls),
``c.SnapKubeSpawner.Backoff…`` (the spawner's).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

from traitlets import Float, Integer, TraitError, validate
from traitlets.config import LoggingConfigurable

T = TypeVar("T")


class Backoff(LoggingConfigurable):
    """How often and how patiently a failed call is tried again."""

    attempts = Integer(
        6,
        help="Tries of one call (the first included) before its error is final. 1: no retry. "
        "For a chunked registry upload this counts the tries of one chunk: a chunk that "
        "gets through starts the count again. Raise it for a registry or API server behind a "
        "flaky load balancer; errors the other side means (any 4xx) are never retried.",
    ).tag(config=True)

    first_delay = Float(
        1.0,
        help="Seconds before the second try; each further wait doubles, up to max_delay. "
        "Every wait is drawn at random between half and all of it (jitter).",
    ).tag(config=True)

    max_delay = Float(
        30.0,
        help="Longest wait in seconds between two tries. With the defaults a call that keeps "
        "failing is given up after about 30 s of waiting (1 + 2 + 4 + 8 + 16 s, less jitter).",
    ).tag(config=True)

    @validate("attempts")
    def _at_least_one(self, proposal):
        if proposal["value"] < 1:
            raise TraitError(
                f"Backoff.attempts must be at least 1 (1: no retry), not {proposal['value']}"
            )
        return proposal["value"]

    def delay(self, failures: int) -> float:
        """The wait after ``failures`` failed tries in a row (1 = after the first)."""
        full = min(self.max_delay, self.first_delay * (2 ** max(0, failures - 1)))
        return random.uniform(full / 2, full)

    async def run(
        self,
        call: Callable[[], Awaitable[T]],
        retryable: Callable[[BaseException], bool],
        what: str,
    ) -> T:
        """Await ``call()`` until it succeeds, raises what ``retryable`` refuses, or has
        failed ``attempts`` times; the last error is raised then. ``what`` names the call in
        the log lines that say a try failed and when the next comes."""
        failures = 0
        while True:
            try:
                return await call()
            except Exception as e:
                failures += 1
                if failures >= self.attempts or not retryable(e):
                    raise
                wait = self.delay(failures)
                self.log.warning(
                    "%s failed (try %d of %d), trying again in %.1fs: %s",
                    what,
                    failures,
                    self.attempts,
                    wait,
                    e,
                )
                await asyncio.sleep(wait)


__all__ = ["Backoff"]
