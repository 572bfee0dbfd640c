"""Bounded retries with jittered exponential backoff, for calls that may fail for a moment.

Registry pushes, API-server calls and node-agent calls go over networks with load
balancers, ingress controllers and pods that restart: a 502 or a refused connection now
says little about a second try. :class:`Backoff` retries such a call a bounded number
of times, waiting longer each time (``retry_backoff`` doubling up to ``retry_backoff_max``, each
wait drawn between half and all of it, so that many agents hit by the same outage do
not come back in step). What is worth retrying is the caller's decision (``retryable``):
never a 4xx, which another try would only repeat.

The names are those of the email's retries (``Mailer.retries``, ``retry_backoff``,
``retry_backoff_max``). Each client has its own Backoff (``parent`` = the client), so the settings apply to all
(``c.Backoff.retries``) or to one client: ``c.RegistryClient.Backoff…`` (registry pushes and
pulls, in the agent), ``c.KubeAPI.Backoff…`` (the agent's API-server calls),
``c.AgentLocator.Backoff…`` (the API-server and agent calls of the service, and of the
spawner's checkpoint lookups and restore), ``c.SnapKubeSpawner.Backoff…`` (the spawner's own
API-server calls).
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

    retries = Integer(
        5,
        help="How many times a failed call is tried again before its error is final (so "
        "1 + retries tries); 0: no retry. For a chunked registry upload this counts the "
        "failures of one chunk: a chunk that gets through starts the count again. Raise it for "
        "a registry or API server behind a flaky load balancer; errors the other side means "
        "(any 4xx) are never retried.",
    ).tag(config=True)

    retry_backoff = Float(
        1.0,
        help="Seconds before the first retry; each further wait doubles, up to "
        "retry_backoff_max. Every wait is drawn at random between half and all of it (jitter).",
    ).tag(config=True)

    retry_backoff_max = Float(
        30.0,
        help="Longest wait in seconds between two tries. With the defaults a call that keeps "
        "failing is given up after about 30 s of waiting (1 + 2 + 4 + 8 + 16 s, less jitter).",
    ).tag(config=True)

    @validate("retries")
    def _not_negative(self, proposal):
        if proposal["value"] < 0:
            raise TraitError(
                f"Backoff.retries must be 0 or more (0: no retry), not {proposal['value']}"
            )
        return proposal["value"]

    @property
    def attempts(self) -> int:
        """Tries of one call, the first included."""
        return self.retries + 1

    def delay(self, failures: int) -> float:
        """The wait after ``failures`` failed tries in a row (1 = after the first)."""
        full = min(self.retry_backoff_max, self.retry_backoff * (2 ** max(0, failures - 1)))
        return random.uniform(full / 2, full)

    async def run(
        self,
        call: Callable[[], Awaitable[T]],
        retryable: Callable[[BaseException], bool],
        what: str,
    ) -> T:
        """Await ``call()`` until it succeeds, raises what ``retryable`` refuses, or has
        failed ``1 + retries`` times; the last error is raised then. ``what`` names the call in
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
