"""User interaction in JupyterLab: a signal the Lab extension pushes, not one the service reads.

Kernels, CPU and GPU say whether the server is working; none of them sees a user who is
reading a notebook, scrolling through results or clicking around without running a cell.
The Lab extension reports such interaction (keys, clicks, wheel scrolling; only trusted
browser events in a visible tab, at most twice a minute) through the server extension to
``POST api/servers/{user}/{name}/interaction``; the service stamps it with its own clock
here, and every tick puts the newest time into the server's sample as
``Sample.last_interaction``. An open tab nobody touches reports nothing, and neither do the
Lab's own polls or websocket heartbeats, unlike the Hub's ``last_activity``.
"""

from __future__ import annotations


class InteractionLog:
    """The newest reported interaction per server (``user/name`` → epoch seconds)."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def record(self, key: str, when: float) -> float:
        """Note an interaction with ``key`` at ``when``; returns the newest one known."""
        newest = max(when, self._last.get(key, when))
        self._last[key] = newest
        return newest

    def get(self, key: str, stored: float | None = None) -> float | None:
        """The newest interaction with ``key``: this log's, or ``stored`` (what the database
        kept from before a service restart), whichever is later."""
        mine = self._last.get(key)
        if mine is None or (stored is not None and stored > mine):
            return stored
        return mine

    def forget(self, key: str) -> None:
        self._last.pop(key, None)
