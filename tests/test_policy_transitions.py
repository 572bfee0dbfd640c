"""Every state change outside a tick's sample is made by policy.transition, and only there.

The table below is the whole of :func:`~jupyterhub_gpusnap.policy.transition`: one row per
(state, event), with the state and the effects that follow. The last tests read the
watcher, the service facade and the handlers and fail if any of them changes a server's
state (or any field the transitions own) by itself again.
"""

from __future__ import annotations

import ast
import sqlite3
from pathlib import Path

import pytest

from jupyterhub_gpusnap.model import Sample, State
from jupyterhub_gpusnap.policy import (
    EVENTS,
    Effect,
    Event,
    Rule,
    ServerStatus,
    decide,
    step,
    tick_effects,
    transition,
)
from jupyterhub_gpusnap.store import Store

T0 = 1_800_000_000.0
NOW = T0 + 5000
PACKAGE = Path(__file__).resolve().parent.parent / "jupyterhub_gpusnap"


def status(state: State = State.idle, **kw) -> ServerStatus:
    base = dict(key="alice/", user="alice", state=state, state_since=T0, last_active=T0, started=T0)
    base.update(kw)
    return ServerStatus(**base)


def moved(was: State, to: State, reason: str) -> Effect:
    return Effect("record", "state", {"from": str(was), "to": str(to), "reason": reason})


S, A, ID, W, P, F, X = (State.suspending, State.active, State.idle, State.warned, State.parked,
                       State.failed, State.exempt)  # fmt: skip
SUSPENDED = State.suspended
RESTORED = {"checkpoint": "c1", "image_bytes": 5, "restored": True, "started": T0 + 4000}
FRESH = {"checkpoint": "c1", "error": "gone", "restored": False, "started": T0 + 4000}

# from state, status fields, event kind, reason, event detail -> state, effects
TABLE = [
    (W, {}, "suspend_started", "idle 1h", {}, S, [moved(W, S, "idle 1h")]),
    (X, {"exempt": True}, "suspend_started", "suspend requested by ada", {}, S,
     [moved(X, S, "suspend requested by ada")]),
    (S, {}, "suspend_refused", "GPU busy", {}, A, [moved(S, A, "GPU busy")]),
    (S, {}, "suspend_failed", "disk full", {}, F,
     [moved(S, F, "disk full"), Effect("record", "suspend_failed", {"error": "disk full"})]),
    (W, {}, "stop_failed", "hub down", {}, F,
     [moved(W, F, "hub down"), Effect("record", "stop_failed", {"error": "hub down"})]),
    (S, {}, "suspended", "idle 1h", {"checkpoint": "c1", "record": {"id": "c1"}}, SUSPENDED,
     [moved(S, SUSPENDED, "idle 1h"), Effect("record", "suspend", {"id": "c1"})]),
    (W, {}, "stopped", "idle 1h", {}, W,
     [Effect("record", "stop", {"reason": "idle 1h"}), Effect("forget")]),
    (SUSPENDED, {}, "returned", "", RESTORED, A,
     [Effect("record", "restore", {"checkpoint": "c1", "image_bytes": 5})]),
    (SUSPENDED, {}, "returned", "", FRESH, A,
     [Effect("record", "restore_failed", {"checkpoint": "c1", "error": "gone"})]),
    (A, {"restored_at": T0 + 4000, "checkpoint_id": "c1"}, "restore_unfinished",
     "lazy restore failed after the server ran: damaged", {"checkpoint": "c1", "error": "damaged"},
     A, [Effect("record", "restore_failed", {"checkpoint": "c1", "error": "damaged"}),
         Effect("forget")]),
    (S, {}, "interrupted", "restart", {"error": "why", "running": True}, A,
     [Effect("record", "suspend_interrupted", {"error": "why"})]),
    (S, {}, "interrupted", "restart", {"error": "why", "running": False}, S,
     [Effect("record", "suspend_interrupted", {"error": "why"}), Effect("forget")]),
    (ID, {}, "park_refused", "park refused: busy", {}, ID, []),
    (P, {}, "park_refused", "park refused: busy", {}, ID, [moved(P, ID, "park refused: busy")]),
    (ID, {}, "parked", "make room", {}, P, [moved(ID, P, "make room")]),
    (W, {}, "parked", "make room", {}, P, [moved(W, P, "make room")]),
    (ID, {}, "keep", "keep running requested", {"until": NOW + 60}, A,
     [moved(ID, A, "keep running requested"), Effect("record", "keep", {"until": NOW + 60})]),
    (W, {}, "keep", "keep running requested", {"until": NOW + 60}, A,
     [moved(W, A, "keep running requested"), Effect("record", "keep", {"until": NOW + 60})]),
    (F, {}, "keep", "keep running requested", {"until": NOW + 60}, A,
     [moved(F, A, "keep running requested"), Effect("record", "keep", {"until": NOW + 60})]),
    (A, {}, "keep", "keep running requested", {"until": NOW + 60}, A,
     [Effect("record", "keep", {"until": NOW + 60})]),
    (P, {}, "keep", "keep running requested", {"until": NOW + 60}, P,
     [Effect("record", "keep", {"until": NOW + 60})]),
    (A, {"keep_until": NOW + 60}, "keep_ended", "suspend requested by ada", {}, A,
     [Effect("record", "keep", {"until": None, "reason": "suspend requested by ada"})]),
    (A, {}, "keep_ended", "suspend requested by ada", {}, A, []),
    (A, {}, "exempt", "exempted by ada", {}, X, [moved(A, X, "exempted by ada")]),
    (ID, {}, "exempt", "exempted by ada", {}, X, [moved(ID, X, "exempted by ada")]),
    (F, {}, "exempt", "exempted by ada", {}, X, [moved(F, X, "exempted by ada")]),
    (P, {}, "exempt", "exempted by ada", {}, X, [moved(P, X, "exempted by ada"), Effect("unpark")]),
    (X, {}, "exempt", "exempted by ada", {}, X, []),
    (S, {}, "exempt", "exempted by ada", {}, S, []),
    (SUSPENDED, {}, "exempt", "exempted by ada", {}, SUSPENDED, []),
    (X, {"exempt": True}, "exempt_lifted", "exemption lifted by ada", {}, A,
     [moved(X, A, "exemption lifted by ada")]),
    (SUSPENDED, {"exempt": True}, "exempt_lifted", "exemption lifted by ada", {}, SUSPENDED, []),
]  # fmt: skip


@pytest.mark.parametrize(
    "was, fields, kind, reason, detail, to, effects",
    TABLE,
    ids=[f"{row[0]}-{row[2]}-{i}" for i, row in enumerate(TABLE)],
)
def test_transition(was, fields, kind, reason, detail, to, effects):
    before = status(was, **fields)
    kept = dict(before.__dict__)
    after, got = transition(before, Event(kind, NOW, reason, detail))
    assert (after.state, got) == (to, effects)
    assert before.__dict__ == kept  # pure: the input is not changed
    if after.state != was:
        assert after.state_since == NOW


def test_every_event_has_a_row():
    assert {row[2] for row in TABLE} == set(EVENTS)
    with pytest.raises(ValueError, match="unknown event 'nap'"):
        transition(status(), Event("nap", NOW))


def test_what_each_transition_writes():
    failed, _ = transition(status(S, failures=2), Event("suspend_failed", NOW, "disk full"))
    assert (failed.failure, failed.failures, failed.reason) == ("disk full", 3, "disk full")
    refused, _ = transition(status(S, last_active=T0), Event("suspend_refused", NOW, "GPU busy"))
    assert refused.last_active == NOW
    done, _ = transition(
        status(S), Event("suspended", NOW, "idle", {"checkpoint": "c9", "record": {}})
    )
    assert done.checkpoint_id == "c9"
    back, _ = transition(
        status(SUSPENDED, restored_at=None, failure="x"), Event("returned", NOW, "", RESTORED)
    )
    assert (back.restored_at, back.last_active, back.started) == (NOW, NOW, T0 + 4000)
    assert (back.reason, back.failure) == ("restored from snapshot", "x")
    fresh, _ = transition(status(SUSPENDED), Event("returned", NOW, "", FRESH))
    assert (fresh.reason, fresh.failure) == ("restore failed: started fresh", "gone")
    kept, _ = transition(status(ID), Event("keep", NOW, "keep", {"until": NOW + 60}))
    assert kept.keep_until == NOW + 60
    ended, _ = transition(status(A, keep_until=NOW + 60), Event("keep_ended", NOW, "by ada"))
    assert ended.keep_until is None
    exempt, _ = transition(status(SUSPENDED), Event("exempt", NOW, "by ada"))
    assert exempt.exempt is True and exempt.state_since == T0  # flag only: it stays suspended
    lifted, _ = transition(
        status(X, exempt=True, keep_until=NOW + 60), Event("exempt_lifted", NOW, "by ada")
    )
    assert (lifted.exempt, lifted.keep_until) == (
        False,
        NOW + 60,
    )  # a keep-running is the user's own


def test_an_exemption_holds_the_idle_clock_and_outlives_a_suspension():
    exempt = status(ID, exempt=True, last_active=T0)
    d = decide(exempt, _quiet(NOW), Rule(), NOW)
    assert (d.state, d.active, d.last_active) == (State.exempt, True, NOW)
    lifted, _ = transition(exempt, Event("exempt_lifted", NOW, "by ada"))
    # lifted: a whole idle window from the moment of lifting, as an ended keep-running gives
    d = decide(status(A, last_active=NOW), _quiet(NOW + 60), Rule(), NOW + 60)
    assert (d.state, d.action, d.suspend_at) == (State.idle, None, NOW + 3600)
    back, _ = transition(status(SUSPENDED, exempt=True), Event("returned", NOW, "", RESTORED))
    d = decide(back, _quiet(NOW + 60), Rule(), NOW + 60)
    assert d.state == State.exempt


def _quiet(t: float) -> Sample:
    return Sample(time=t, kernels=1, kernels_busy=0, cpu_percent=0.0, gpu_percent=0.0)


def test_restoring_is_not_a_state():
    """A restore runs inside the Hub's spawn: the service never saw it, so there is no such state.
    A row an older version stored as "restoring" reads as suspended, which ticks leave alone."""
    assert "restoring" not in State.__members__
    d = decide(status(SUSPENDED), _quiet(NOW), Rule(), NOW)
    assert (d.state, d.action) == (SUSPENDED, None)


def test_an_older_database_reads_the_year_2100_keep_as_an_exemption(tmp_path):
    """Older versions stored an admin's exemption as keep_until 2100-01-01, without an exempt column."""
    path = tmp_path / "old.sqlite"
    con = sqlite3.connect(path)
    con.execute(
        "CREATE TABLE servers (key VARCHAR(255) PRIMARY KEY, user VARCHAR(255) NOT NULL, name VARCHAR(255) "
        "NOT NULL, state VARCHAR(32) NOT NULL, state_since FLOAT NOT NULL, last_active FLOAT NOT NULL, "
        "started FLOAT NOT NULL, keep_until FLOAT, restored_at FLOAT, rule VARCHAR(255) NOT NULL, reason TEXT "
        "NOT NULL, checkpoint_id VARCHAR(1024) NOT NULL, failure TEXT NOT NULL, failures INTEGER NOT NULL, "
        "last_sample JSON NOT NULL, warned_at FLOAT)"
    )
    row = (
        "INSERT INTO servers VALUES (?, ?, '', ?, 1, 1, 1, ?, NULL, '', '', '', '', 0, '{}', NULL)"
    )
    con.execute(row, ("alice/", "alice", "active", 4102444800.0))
    con.execute(row, ("bob/", "bob", "idle", T0))
    con.execute(row, ("carol/", "carol", "restoring", None))
    con.commit()
    con.close()
    with Store(f"sqlite:///{path}") as store:
        alice, bob, carol = store.get("alice/"), store.get("bob/"), store.get("carol/")
        assert (alice.exempt, alice.keep_until) == (True, None)
        assert (bob.exempt, bob.keep_until) == (False, T0)
        assert carol.state == State.suspended
        assert store.exempt("alice/") is True and store.exempt("nobody/", missing=None) is None
        with store.batch(preload=True):
            assert store.exempt("alice/") is True and store.exempt("bob/") is False
    with Store(f"sqlite:///{path}") as store:  # opening it again changes nothing
        assert store.get("alice/").exempt is True


# ------------------------------------------------------------------ nowhere else

#: What the transitions own in a ServerStatus: nobody else assigns these.
OWNED = {"state", "state_since", "reason", "failure", "failures", "checkpoint_id", "restored_at",
         "last_active", "started", "warned_at", "keep_until", "exempt"}  # fmt: skip
#: The one exception: a tick's copy of a status takes the keep-running and exemption the API
#: stored meanwhile (what the store says, not a transition).
MERGE = ("_merge_keep", {"keep_until", "exempt"})
CALLERS = [
    "watcher.py",
    "room.py",
    "service.py",
    "app.py",
    *(f"handlers/{p.name}" for p in (PACKAGE / "handlers").glob("*.py")),
]


def _assignments(path: Path):
    """(function, attribute, line) of every assignment to an attribute in ``path``."""
    tree = ast.parse(path.read_text())
    for func in [
        n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]:
        for node in ast.walk(func):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store):
                        yield func.name, t.attr, node.lineno


@pytest.mark.parametrize("name", CALLERS)
def test_no_transition_outside_the_policy(name):
    found = [
        f"{name}:{line} {func}() sets .{attr}"
        for func, attr, line in _assignments(PACKAGE / name)
        if attr in OWNED and not (func == MERGE[0] and attr in MERGE[1])
    ]
    assert found == [], "a state change belongs in policy.transition: " + "; ".join(found)
    text = (PACKAGE / name).read_text()
    assert "_set_state" not in text and "EXEMPT_UNTIL" not in text


def test_handlers_go_through_the_service():
    for path in (PACKAGE / "handlers").glob("*.py"):
        assert ".watcher" not in path.read_text(), (
            f"{path.name} reaches into the watcher; use self.service"
        )


def test_a_ticks_decision_is_its_effects():
    """A tick's one action reaches the watcher's executor as an effect, like an event's."""
    warned = decide(status(ID, last_active=T0), _quiet(T0 + 2700), Rule(min_running=0), T0 + 2700)
    assert (warned.state, warned.effects) == (W, [Effect("warn")])
    quiet = decide(status(ID, last_active=T0), _quiet(T0 + 100), Rule(min_running=0), T0 + 100)
    assert (quiet.state, quiet.effects) == (ID, [])


def test_a_ticks_state_change_is_an_effect_as_a_transitions_is():
    """What a tick changes is recorded as transition records it: a ``state`` record from the
    old state first, then the decision's action; no record when the state stays."""
    rule = Rule(min_running=0)
    was = status(ID, last_active=T0)
    new, warned = step(was, _quiet(T0 + 2700), rule, T0 + 2700)
    assert new.state == W
    assert tick_effects(was.state, warned) == [moved(ID, W, warned.reason), Effect("warn")]
    _, quiet = step(was, _quiet(T0 + 100), rule, T0 + 100)
    assert quiet.state == ID and tick_effects(ID, quiet) == []
    busy = Sample(time=T0 + 100, kernels=1, kernels_busy=1, cpu_percent=0.0, gpu_percent=0.0)
    _, active = step(status(ID), busy, rule, T0 + 100)
    assert tick_effects(ID, active) == [moved(ID, A, active.reason)]
