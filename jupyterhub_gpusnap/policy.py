"""When to warn, park, suspend or stop a server: rules and the per-server state machine.

Pure functions over :class:`~jupyterhub_gpusnap.model.Sample` s and a persisted
:class:`ServerStatus` — no I/O, no clock — so every transition is unit-testable.

Activity (:func:`is_active`): a busy kernel, Jupyter activity newer than the last
activity seen, CPU above ``cpu_threshold`` or GPU SM above ``gpu_threshold``. GPU
memory held is never activity (an idle process holds gigabytes at 0 %). The Hub's
``last_activity`` is ignored: the proxy moves it for every websocket frame,
including heartbeats from a forgotten browser tab, so it would keep idle servers
alive forever. A sample without Jupyter data counts as active: never suspend on
missing data. The idle clock runs from ``max(last_active, started, restored_at)``,
so it restarts after a restore.

User interaction (``Sample.last_interaction``: a key, click or scroll in a visible
JupyterLab tab, reported by the Lab extension) is a signal of its own with its own
window: a server is not suspended before ``last_interaction + interaction_window``,
whatever the idle clock says, and "idle for" counts from the later of the two. A
user reading their notebook without running a cell is not suspended under them;
an open tab nobody touches reports nothing.

Every state change of a server is made here, by one of two pure functions; the
watcher persists what they return and carries out their effects.

Transitions made by :func:`decide` on a tick's sample (``idle`` = seconds on the idle clock)::

    from                      condition                                   to          action
    any                       rule exempt or action "none", or exempted   exempt      unpark if parked
                                by an admin (``ServerStatus.exempt``)
    suspending/suspended      (owned by the suspension and the spawner)   unchanged   -
    any other                 active sample, a new Lab interaction, or    active      unpark if parked
                                keep_until in the future
    failed                    idle, within failure_backoff of failing     failed      -
    active/idle/warned/failed younger than min_running                    idle        -
    (same)                    idle >= idle_window (and interaction_window suspending  suspend (or stop)
                                after the last interaction), warning given*
    (same)                    idle >= idle_window - warn_before, no        warned      warn (once)
                                warning given in this idle period
    (same)                    idle >= park_window, GPU memory held        parked      park (once)
    (same)                    otherwise                                   idle/warned -
    parked                    as above, but stays parked until suspended  parked      warn if due

    * a warning is always given warn_before seconds ahead: a server found past its
      deadline (after the service was down) is warned first and suspended later.

Transitions made by :func:`transition` on everything else that happens to a server
(an :class:`Event`: a suspension's outcome, a restore seen, a user's or admin's request)::

    event              from                        to                      effects
    suspend_started    any                         suspending              state
    suspend_refused    any                         active (last_active)    state
    suspend_failed     any                         failed (failures + 1)   state, suspend_failed event
    stop_failed        any                         failed (failures + 1)   state, stop_failed event
    suspended          any                         suspended               state, suspend event
    stopped            any                         (record dropped)        stop event, forget
    returned           suspended                   active (restored_at)    restore or restore_failed event
    restore_unfinished any (gone after a restore   (record dropped)        restore_failed event, forget
                       that could not finish)
    interrupted        suspending, server runs     active                  suspend_interrupted event
                       suspending, server gone     (record dropped)        suspend_interrupted event, forget
    park_refused       any                         idle                    state
    parked             idle/warned                 parked                  state
    keep               idle/warned/failed          active                  state, keep event
                       any other                   unchanged               keep event
    keep_ended         any, kept running           unchanged               keep event
                       any other                   unchanged               -
    exempt             suspending/suspended        unchanged               -
                       parked                      exempt                  state, unpark
                       any other                   exempt                  state
    exempt_lifted      exempt                      active                  state
                       any other                   unchanged               -

``state`` records a ``state`` event (from, to, reason) when the state changes; a tick's
state change is recorded the same way (:func:`tick_effects`). An admin's
exemption is the ``exempt`` flag of the status and the ``exempt`` state while the server
runs: it outlives a "suspend now" and the restore after it.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools
import re
import time
from dataclasses import dataclass, field

from .model import Sample, Server, State

ACTIONS = ("suspend", "stop", "none")
#: The reason an admin-exempted server is given on each tick.
EXEMPTED = "exempted by an admin"
_OWNED = (State.suspending, State.suspended)
_SAMPLE_FIELDS = tuple(Sample.__dataclass_fields__)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _seconds_hint(v: object) -> str:
    """Suggest the number of seconds for a value like '1h' or '30m', if it is one."""
    m = re.fullmatch(r"\s*(?:(\d+)\s*h)?\s*(?:(\d+)\s*m(?:in)?)?\s*(?:(\d+)\s*s)?\s*", str(v))
    if isinstance(v, str) and m and any(m.groups()):
        h, mi, s = (int(g or 0) for g in m.groups())
        return f"; write {h * 3600 + mi * 60 + s}"
    return ""


def _fmt_duration(seconds: float) -> str:
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _fmt_time(t: float) -> str:
    return _fmt_minute(int(t // 60))


@functools.lru_cache(maxsize=4096)
def _fmt_minute(minute: int) -> str:
    """The UTC minute ``minute`` (minutes since the epoch), formatted once: every idle
    server's reason names its suspension time, and thousands share a few minutes."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(minute * 60))


@dataclass
class Rule:
    """One policy rule: which servers it covers and how idleness is handled for them.

    A rule matches a server when each of its non-empty matchers matches (``users``,
    ``groups``, ``profiles`` are fnmatch globs; one matching entry per list is enough);
    a rule without matchers matches everyone. Times are seconds. Invalid values raise
    ``ValueError`` naming the rule, the key and the fix.
    """

    name: str = "default"
    users: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    profiles: list[str] = field(default_factory=list)
    exempt: bool = False
    action: str = "suspend"  # suspend: checkpoint; stop: plain stop (cannot checkpoint); none
    idle_window: float = 3600.0
    park_window: float | None = None  # move GPU memory to host RAM this early; < idle_window
    warn_before: float = 900.0  # email this long before suspension; 0 = no warning
    min_running: float = 600.0
    cpu_threshold: float = 10.0  # percent of one core
    gpu_threshold: float = 5.0  # SM percent
    max_keep_running: float = 8 * 3600.0
    failure_backoff: float = 3600.0  # after a failed suspension, wait this long to retry
    # seconds a Lab interaction holds off suspension; None: idle_window
    interaction_window: float | None = None

    @property
    def interaction_seconds(self) -> float:
        """How long after the user's last interaction in JupyterLab the server is not
        suspended (0: interaction does not count)."""
        return self.idle_window if self.interaction_window is None else self.interaction_window

    def _fail(self, key: str, problem: str, fix: str) -> None:
        raise ValueError(f"rule {self.name!r}: {key} {problem}{fix}")

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"rule name must be a non-empty string, got {self.name!r}")
        for key in ("users", "groups", "profiles"):
            v = getattr(self, key)
            if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
                fix = f"; write [{v!r}]" if isinstance(v, str) else ""
                self._fail(key, f"must be a list of glob patterns, got {v!r}", fix)
            setattr(self, key, list(v))
        if not isinstance(self.exempt, bool):
            self._fail("exempt", f"must be true or false, got {self.exempt!r}", "")
        if self.action not in ACTIONS:
            self._fail("action", f"must be one of {', '.join(ACTIONS)}, got {self.action!r}", "")
        positive = ("idle_window", "max_keep_running")
        for key in ("idle_window", "warn_before", "min_running", "cpu_threshold",
                    "gpu_threshold", "max_keep_running", "failure_backoff"):  # fmt: skip
            v = getattr(self, key)
            if not _is_number(v) or v < 0 or (key in positive and v == 0):
                what = "> 0" if key in positive else ">= 0"
                unit = "percent" if key.endswith("threshold") else "seconds"
                self._fail(key, f"must be a number of {unit} {what}, got {v!r}", _seconds_hint(v))
        if self.interaction_window is not None and (
            not _is_number(self.interaction_window) or self.interaction_window < 0
        ):
            self._fail(
                "interaction_window",
                f"must be a number of seconds >= 0 or null (= idle_window), got {self.interaction_window!r}",
                _seconds_hint(self.interaction_window),
            )
        if self.park_window is not None and (
            not _is_number(self.park_window) or self.park_window <= 0
        ):
            self._fail(
                "park_window",
                f"must be a number of seconds > 0 or null, got {self.park_window!r}",
                _seconds_hint(self.park_window),
            )
        if self.park_window is not None and self.park_window >= self.idle_window:
            self._fail(
                "park_window",
                f"({self.park_window:g}) must be less than idle_window ({self.idle_window:g})",
                "; lower park_window or remove it",
            )
        if self.warn_before >= self.idle_window:
            self._fail(
                "warn_before",
                f"({self.warn_before:g}) must be less than idle_window ({self.idle_window:g})",
                "; lower warn_before (0 = no warning)",
            )

    @classmethod
    def from_dict(cls, d: dict, default_name: str = "unnamed") -> Rule:
        """Build a rule from configuration (e.g. one entry of ``c.GpuSnap.rules``)."""
        if not isinstance(d, dict):
            raise ValueError(f"rule {default_name!r} must be a mapping of keys, got {d!r}")
        known = [f.name for f in dataclasses.fields(cls)]
        name = d.get("name", default_name)
        for key in d:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                fix = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
                raise ValueError(f"rule {name!r}: unknown key {key!r}; {fix}")
        return cls(**{**d, "name": name})

    def matches(self, server: Server) -> bool:
        """Whether this rule covers ``server`` (user name, Hub groups, profile)."""

        def any_match(values: list[str], patterns: list[str]) -> bool:
            return any(fnmatch.fnmatchcase(v, p) for v in values for p in patterns)

        return (
            (not self.users or any_match([server.user], self.users))
            and (not self.groups or any_match(server.groups, self.groups))
            and (not self.profiles or any_match([server.profile], self.profiles))
        )


class Policy:
    """Ordered rules: the first that matches a server wins, else ``default``."""

    def __init__(self, rules: list[Rule], default: Rule | None = None):
        names = [r.name for r in rules]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"rule names must be unique; rename the rules named {dupes}")
        self.rules = list(rules)
        self.default = default or Rule()

    @classmethod
    def from_config(cls, rules: list[dict], default: dict | None = None) -> Policy:
        """Build from plain configuration: a list of rule mappings and the default's mapping."""
        built = [Rule.from_dict(d, default_name=f"rules[{i}]") for i, d in enumerate(rules)]
        return cls(built, Rule.from_dict(default or {}, default_name="default"))

    def rule_for(self, server: Server) -> Rule:
        if not self.rules:
            return self.default
        return next((r for r in self.rules if r.matches(server)), self.default)


def clamp_keep(requested_until: object, now: float, rule: Rule) -> float:
    """A user's "keep running until T", limited to ``now + rule.max_keep_running``."""
    if not _is_number(requested_until):
        raise ValueError(
            f"keep-running time must be a number of seconds since the epoch, got {requested_until!r}"
        )
    if requested_until <= now:
        raise ValueError(
            f"keep-running time {_fmt_time(requested_until)} is in the past; choose a later time"
        )
    return float(min(requested_until, now + rule.max_keep_running))


def _activity(sample: Sample, rule: Rule, since: float) -> tuple[str, float] | None:
    """The first sign of activity in ``sample`` and when it happened, or None."""
    if "jupyter" in sample.errors:
        return f"no signal: jupyter ({sample.errors['jupyter']})", sample.time
    if sample.kernels_busy:
        n = sample.kernels_busy
        return ("kernel busy" if n == 1 else f"{n} kernels busy"), sample.time
    if sample.gpu_percent is not None and sample.gpu_percent > rule.gpu_threshold:
        return f"gpu {sample.gpu_percent:.0f}% > {rule.gpu_threshold:g}%", sample.time
    if sample.cpu_percent is not None and sample.cpu_percent > rule.cpu_threshold:
        return f"cpu {sample.cpu_percent:.0f}% > {rule.cpu_threshold:g}%", sample.time
    last = sample.jupyter_last_activity
    if last is not None and last > since:
        return "kernel/terminal activity", min(last, sample.time)
    return None


def interaction(sample: Sample, rule: Rule) -> float | None:
    """When the user last used JupyterLab, if ``rule`` counts it (epoch s), else None."""
    touch = sample.last_interaction
    if touch is None or rule.interaction_seconds <= 0:
        return None
    return min(touch, sample.time)


def is_active(sample: Sample, rule: Rule, since: float) -> tuple[bool, str]:
    """Whether ``sample`` shows activity after ``since`` (epoch s), and a short reason."""
    found = _activity(sample, rule, since)
    if found:
        return True, found[0]
    quiet = []
    if sample.cpu_percent is not None:
        quiet.append(f"cpu {sample.cpu_percent:.0f}%")
    if sample.gpu_percent is not None:
        quiet.append(f"gpu {sample.gpu_percent:.0f}%")
    return False, "quiet" + (f" ({', '.join(quiet)})" if quiet else "")


@dataclass
class ServerStatus:
    """What the service keeps per server (one row of the ``servers`` table). Times: epoch s."""

    key: str
    user: str
    name: str = ""
    state: State = State.active
    state_since: float = 0.0
    last_active: float = 0.0  # last time any signal showed activity
    started: float = 0.0
    keep_until: float | None = None  # the user asked to keep it running until then
    restored_at: float | None = None
    rule: str = ""
    reason: str = ""  # why it was last seen active
    checkpoint_id: str = ""
    failure: str = ""
    failures: int = 0
    last_sample: dict = field(default_factory=dict)
    warned_at: float | None = None  # when the user was last warned (one warning per idle period)
    exempt: bool = False  # an admin exempted it: never suspended by the policy


@dataclass(frozen=True)
class Decision:
    """The outcome of one :func:`decide`: next state, the one action to take, and the clock."""

    state: State
    action: str | None  # None, "warn", "park", "unpark", "suspend", "stop"
    reason: str
    idle_seconds: float
    suspend_at: float | None = None
    park_at: float | None = None
    warn_at: float | None = None
    active: bool = False  # the sample (or a keep request) showed activity
    last_active: float = 0.0  # the status's new last_active
    idle_since: float | None = None  # when the idle period began (last activity or interaction)

    @property
    def effects(self) -> list[Effect]:
        """The effects of this tick for the watcher to carry out: its one action, if any."""
        return [Effect(self.action)] if self.action else []


def decide(status: ServerStatus, sample: Sample, rule: Rule, now: float) -> Decision:
    """The next state and action for one server, from its status, a fresh sample and its rule."""
    state = status.state
    unpark = "unpark" if state == State.parked else None
    if state in _OWNED:
        base = max(status.last_active, status.started, status.restored_at or 0.0)
        return Decision(state, None, f"{state} (in progress elsewhere)", now - base,
                        last_active=status.last_active)  # fmt: skip
    found = _activity(sample, rule, since=status.last_active)
    touch = interaction(sample, rule)
    if not found and touch is not None:
        seen = (status.last_sample or {}).get("last_interaction")
        if seen is None or touch > seen:  # a new interaction: the user is here
            found = ("JupyterLab in use", None)
    if status.keep_until is not None and status.keep_until > now:
        found = (f"kept running until {_fmt_time(status.keep_until)}", now)
    if status.exempt:  # the idle clock holds while exempt, as it does while kept running
        found = (EXEMPTED, now)
    moved = found is not None and found[1] is not None
    last_active = max(status.last_active, min(found[1], now)) if moved else status.last_active
    base = max(last_active, status.started, status.restored_at or 0.0)
    start = max(base, touch or 0.0)  # the idle period starts at the latest sign of the user
    idle = max(now - start, 0.0)
    common = {
        "idle_seconds": idle,
        "active": bool(found),
        "last_active": last_active,
        "idle_since": start,
    }
    if status.exempt:
        return Decision(State.exempt, unpark, EXEMPTED, **common)
    if rule.exempt or rule.action == "none":
        why = "exempt" if rule.exempt else "action none"
        return Decision(State.exempt, unpark, f"rule {rule.name!r}: {why}", **common)
    if found:
        return Decision(State.active, unpark, found[0], **common)
    if state == State.failed and now - status.state_since < rule.failure_backoff:
        retry = _fmt_time(status.state_since + rule.failure_backoff)
        return Decision(State.failed, None, f"failed: {status.failure}; retry at {retry}", **common)

    deadline = base + rule.idle_window
    if touch is not None:
        deadline = max(deadline, touch + rule.interaction_seconds)
    warn_at = deadline - rule.warn_before if rule.warn_before else None
    park_at = start + rule.park_window if rule.park_window is not None else None
    warned_at = status.warned_at
    if warned_at is None or warned_at < start:  # a warning counts for this idle period only
        warned_at = status.state_since if state == State.warned else None
    warned = warned_at is not None
    suspend_at = deadline
    if warned and rule.warn_before:
        suspend_at = max(suspend_at, warned_at + rule.warn_before)
    elif rule.warn_before and now >= warn_at:  # the warning about to go out
        suspend_at = max(suspend_at, now + rule.warn_before)
    common.update(suspend_at=suspend_at, park_at=park_at, warn_at=warn_at)
    idle_for = f"idle {_fmt_duration(idle)}"
    keep = State.parked if state == State.parked else State.warned if warned else State.idle

    if now - max(status.started, status.restored_at or 0.0) < rule.min_running:
        return Decision(keep, None, f"{idle_for}; younger than min_running", **common)
    if now >= suspend_at and (warned or not rule.warn_before):
        return Decision(State.suspending, rule.action, f"{idle_for} >= idle_window", **common)
    if warn_at is not None and now >= warn_at and not warned:
        to = State.parked if state == State.parked else State.warned
        return Decision(to, "warn", f"{idle_for}; suspends at {_fmt_time(suspend_at)}", **common)
    if park_at is not None and now >= park_at and state != State.parked:
        if sample.gpu_memory_bytes:
            return Decision(State.parked, "park", f"{idle_for} >= park_window", **common)
    return Decision(keep, None, f"{idle_for}; suspends at {_fmt_time(suspend_at)}", **common)


def step(
    status: ServerStatus, sample: Sample, rule: Rule, now: float
) -> tuple[ServerStatus, Decision]:
    """Decide, and return the status updated with the decision (the caller persists it)."""
    d = decide(status, sample, rule, now)
    changes: dict = {"state": d.state, "last_active": d.last_active, "rule": rule.name}
    if d.state != status.state:
        changes["state_since"] = now
    if d.active and status.state not in _OWNED:
        changes["reason"] = d.reason
    if d.action == "warn":
        changes["warned_at"] = now
    if status.keep_until is not None and status.keep_until <= now:
        changes["keep_until"] = None
    if status.state not in _OWNED:
        fields = sample.__dict__  # Sample.as_dict() without a getattr per field
        changes["last_sample"] = {k: fields[k] for k in _SAMPLE_FIELDS}
    # a shallow copy with the changes: what dataclasses.replace does, a tenth of the cost
    # (this runs for every server on every tick; ServerStatus has no __post_init__)
    new = object.__new__(ServerStatus)
    new.__dict__.update(status.__dict__, **changes)
    return new, d


def tick_effects(was: State, decision: Decision) -> list[Effect]:
    """The effects of a tick for the watcher to carry out, in order: the state change
    :func:`step` made (from ``was``), recorded as :func:`transition` records one, then the
    decision's action."""
    if decision.state == was:
        return decision.effects
    return [_state_record(was, decision.state, decision.reason), *decision.effects]


@dataclass(frozen=True)
class Event:
    """Something that happened to a server besides a tick's sample (see :func:`transition`).

    ``kind`` is one of :data:`EVENTS`; ``time`` when it happened (epoch s); ``reason`` the
    words the state change is logged and recorded with; ``detail`` what the event carries
    (``error``, ``checkpoint``, ``until``, ``started``, ``restored``, an event record's detail).
    """

    kind: str
    time: float
    reason: str = ""
    detail: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Effect:
    """One thing the watcher does for a transition: ``record`` an event of ``kind`` with
    ``detail`` in the server's history, ``unpark`` its GPU memory, or ``forget`` its record."""

    action: str
    kind: str = ""
    detail: dict = field(default_factory=dict)


#: Event kinds :func:`transition` takes.
EVENTS = (
    "suspend_started", "suspend_refused", "suspend_failed", "stop_failed", "suspended", "stopped",
    "returned", "restore_unfinished", "interrupted", "park_refused", "parked", "keep", "keep_ended",
    "exempt", "exempt_lifted",
)  # fmt: skip
_FAILED = {"suspend_failed", "stop_failed"}
_RUNNING = (State.active, State.idle, State.warned, State.parked, State.failed, State.exempt)


def transition(status: ServerStatus, event: Event) -> tuple[ServerStatus, list[Effect]]:
    """The status after ``event`` and the effects to carry out, in order (the module's
    second table). Pure: ``status`` is not changed; the caller persists the result."""
    kind, now, reason, detail = event.kind, event.time, event.reason, event.detail
    changes: dict = {}
    effects: list[Effect] = []
    to = status.state
    if kind == "suspend_started":
        to = State.suspending
    elif kind == "suspend_refused":
        to, changes["last_active"] = State.active, now
    elif kind in _FAILED:
        to = State.failed
        changes.update(failure=reason, failures=(status.failures or 0) + 1)
        effects.append(Effect("record", kind, {"error": reason}))
    elif kind == "suspended":
        to, changes["checkpoint_id"] = (
            State.suspended,
            detail.get("checkpoint", status.checkpoint_id),
        )
        effects.append(Effect("record", "suspend", detail.get("record", {})))
    elif kind == "stopped":
        return status, [Effect("record", "stop", {"reason": reason}), Effect("forget")]
    elif kind == "returned":
        restored = bool(detail.get("restored"))
        changes.update(state=State.active, state_since=now, restored_at=now, last_active=now,
                       started=detail.get("started") or now,
                       reason="restored from snapshot" if restored else "restore failed: started fresh")  # fmt: skip
        if not restored:
            changes["failure"] = detail.get("error")
        record = {k: v for k, v in detail.items() if k not in ("restored", "started")}
        effects.append(Effect("record", "restore" if restored else "restore_failed", record))
        return _replaced(status, changes), effects
    elif kind == "restore_unfinished":
        # a lazy restore handed the server out, then could not bring all of it back (a
        # damaged page, its GPU memory): the server was stopped; its checkpoint is kept
        return status, [Effect("record", "restore_failed", dict(detail)), Effect("forget")]
    elif kind == "interrupted":
        record = Effect("record", "suspend_interrupted", {"error": detail.get("error", "")})
        if not detail.get("running", True):
            return status, [record, Effect("forget")]
        changes.update(state=State.active, state_since=now, last_active=now, reason=reason)
        return _replaced(status, changes), [record]
    elif kind == "park_refused":
        to = State.idle
    elif kind == "parked":
        to = State.parked if status.state in (State.idle, State.warned) else status.state
    elif kind in ("keep", "keep_ended"):
        if kind == "keep_ended" and status.keep_until is None:
            return status, []
        until = detail.get("until")
        changes["keep_until"] = until
        if kind == "keep" and status.state in (State.idle, State.warned, State.failed):
            to = State.active
        record = {"until": until} if kind == "keep" else {"until": None, "reason": reason}
        new = _replaced(status, changes)
        if to != status.state:
            new = _replaced(new, {"state": to, "state_since": now, "reason": reason})
            effects.append(_state_record(status.state, to, reason))
        return new, [*effects, Effect("record", "keep", record)]
    elif kind == "exempt":
        changes["exempt"] = True
        if status.state in _RUNNING:
            to = State.exempt
            if status.state == State.parked:
                effects.append(Effect("unpark"))
        else:
            return _replaced(status, changes), []
    elif kind == "exempt_lifted":
        changes["exempt"] = False
        if status.state != State.exempt:
            return _replaced(status, changes), []
        to = State.active
    else:
        raise ValueError(f"unknown event {kind!r}; one of {', '.join(EVENTS)}")
    changes.update(state=to, state_since=now, reason=reason)
    if to != status.state:
        effects.insert(0, _state_record(status.state, to, reason))
    return _replaced(status, changes), effects


def _state_record(was: State, to: State, reason: str) -> Effect:
    return Effect("record", "state", {"from": str(was), "to": str(to), "reason": reason})


def _replaced(status: ServerStatus, changes: dict) -> ServerStatus:
    new = object.__new__(ServerStatus)
    new.__dict__.update(status.__dict__, **changes)
    return new
