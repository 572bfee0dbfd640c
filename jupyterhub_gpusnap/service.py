"""What the REST API and the pages may ask of the service, in one place.

Handlers read a server's status as the one JSON shape the API, the pages and the Lab
panel share (:meth:`Service.model`), and pass on the requests of users and admins (keep
running, exempt, suspend now, an interaction in JupyterLab, make room). They never reach
into the watcher: every state change goes through the policy's transitions, which the
watcher carries out.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timezone

from .model import Server, State
from .policy import Policy, ServerStatus
from .store import Store
from .watcher import OFFLINE, Watcher


class NotRunning(Exception):
    """The server is not running (suspended or being suspended): nothing to act on."""


def iso(ts: float | None) -> str | None:
    """Epoch seconds as ISO 8601 in UTC (``2026-11-22T18:00:00Z``), None for None."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


class Service:
    """The facade between the handlers and the watcher (one per service process)."""

    def __init__(
        self,
        watcher: Watcher,
        store: Store,
        policy: Policy,
        action: str = "suspend",
        clock: Callable[[], float] = time.time,
    ):
        self.watcher = watcher
        self.store = store
        self.policy = policy
        self.action = action
        self.clock = clock

    # ------------------------------------------------------------------ reading
    def get(self, key: str) -> ServerStatus | None:
        return self.store.get(key)

    def all(self) -> list[ServerStatus]:
        return self.store.all()

    def events(self, key: str | None, limit: int = 50) -> list[dict]:
        return self.store.events(key, limit=limit)

    def model(self, status: ServerStatus, with_events: bool = True) -> dict:
        """The JSON of one server's status: the one shape the API, pages and Lab panel share."""
        watcher = self.watcher
        decision = watcher.decisions.get(status.key)
        server = watcher.servers.get(status.key)
        rule = self.policy.rule_for(server) if server else self.policy.default
        # a suspended server's processes are gone, though the last tick's list of the Hub's
        # servers may hold it until the next tick
        running = server if status.state != State.suspended else None
        now = self.clock()
        kept = status.keep_until is not None and status.keep_until > now
        # while kept running (or exempt) nothing is scheduled: no countdown beside "kept running until"
        suspend_at = decision.suspend_at if decision and not kept else None
        touch = (status.last_sample or {}).get("last_interaction")
        if status.state not in OFFLINE:
            touch = watcher.interactions.get(status.key, touch)
        model = {
            "server": status.key,
            "user": status.user,
            "name": status.name,
            "state": str(status.state),
            "state_since": iso(status.state_since),
            "running": running is not None,
            "url": running.url if running else None,
            "rule": status.rule or rule.name,
            "reason": status.reason,
            "last_active": iso(status.last_active),
            "idle_seconds": round(decision.idle_seconds, 1)
            if decision and decision.idle_seconds is not None
            else None,
            "idle_since": iso(decision.idle_since) if decision and not decision.active else None,
            "warn_at": iso(suspend_at - rule.warn_before)
            if suspend_at and rule.warn_before
            else None,
            "suspend_at": iso(suspend_at),
            "park_at": iso(decision.park_at) if decision else None,
            "keep_until": iso(status.keep_until),
            "exempt": status.exempt or status.state == State.exempt,
            "max_keep_running": rule.max_keep_running,
            "idle_window": rule.idle_window,
            "action": rule.action,
            "last_interaction": iso(touch),
            "interaction_window": rule.interaction_seconds,
            "restored_at": iso(status.restored_at),
            "checkpoint_id": status.checkpoint_id,
            "failure": status.failure,
            "signals": status.last_sample or {},
        }
        if with_events:
            model["events"] = [
                {**e, "time": iso(e["time"])} for e in self.store.events(status.key, limit=20)
            ]
        return model

    # ----------------------------------------------------------------- requests
    def keep(self, key: str, until: float) -> ServerStatus:
        """Keep ``key`` running until ``until`` (epoch s, limited by its rule's max_keep_running).

        Raises KeyError for an unknown server, ValueError for a time that cannot be kept.
        """
        return self.watcher.request_keep(key, until)

    def exempt(self, key: str, exempt: bool, by: str) -> ServerStatus:
        """Exempt ``key`` from suspension, or lift its exemption (an admin, named ``by``)."""
        return self.watcher.request_exempt(key, exempt, by)

    def suspend_now(self, key: str, by: str) -> ServerStatus:
        """Suspend ``key`` now, in the background ("suspend now" ends a keep-running, not an
        exemption). Raises :class:`NotRunning` if it is not running, KeyError if unknown."""
        status = self.store.get(key)
        if status is None:
            raise KeyError(key)
        server: Server | None = self.watcher.servers.get(key)
        if server is None or status.state in OFFLINE:
            raise NotRunning(f"{key} is {status.state}, not running: nothing to suspend")
        self.watcher.clear_keep(status, f"suspend requested by {by}")
        self.watcher.start_suspend(
            server, plain_stop=(self.action == "stop"), reason=f"suspend requested by {by}"
        )
        return status

    def interaction(self, key: str) -> float:
        """The user used JupyterLab on ``key`` just now; KeyError if it is not running."""
        return self.watcher.record_interaction(key)

    async def make_room(self, nbytes: int, gpu: int | None = None, node: str | None = None) -> dict:
        """Park idle servers until ``nbytes`` of GPU memory are free (see Watcher.make_room)."""
        return await self.watcher.room.make_room(nbytes, gpu=gpu, node=node)
