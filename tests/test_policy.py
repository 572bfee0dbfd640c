"""The policy: activity, rule matching and validation, and every state-machine transition."""

from __future__ import annotations

import dataclasses

import pytest

from jupyterhub_gpusnap.model import Server, State
from jupyterhub_gpusnap.policy import (
    Decision,
    Policy,
    Rule,
    clamp_keep,
    decide,
    is_active,
    step,
)
from tests.helpers.policy_samples import T0, quiet, status

GIB = 1 << 30


# ---------------------------------------------------------------- is_active


@pytest.mark.parametrize(
    "fields, active, reason",
    [
        (dict(kernels_busy=1, cpu_percent=0.0), True, "kernel busy"),
        (dict(kernels_busy=3), True, "3 kernels busy"),
        (dict(cpu_percent=87.0), True, "cpu 87% > 10%"),
        (dict(gpu_percent=94.0), True, "gpu 94% > 5%"),
        (dict(jupyter_last_activity=T0 + 988), True, "kernel/terminal activity"),
        (dict(errors={"jupyter": "timeout"}), True, "no signal: jupyter (timeout)"),
        # GPU memory is not activity, nor the Hub's heartbeat-driven last_activity
        (dict(gpu_memory_bytes=8 * GIB, gpu_percent=1.0), False, "quiet (cpu 0%, gpu 1%)"),
        (dict(hub_last_activity=T0 + 999), False, "quiet (cpu 0%, gpu 0%)"),
        # another source failing, or None fields, say nothing
        (dict(errors={"gpu": "NVML not found"}, gpu_percent=None), False, "quiet (cpu 0%)"),
        (dict(cpu_percent=None, gpu_percent=None, kernels_busy=None), False, "quiet"),
        (dict(cpu_percent=10.0, gpu_percent=5.0), False, "quiet (cpu 10%, gpu 5%)"),
        (dict(jupyter_last_activity=T0 + 500), False, "quiet (cpu 0%, gpu 0%)"),  # not after since
    ],
)
def test_is_active(fields, active, reason):
    sample = quiet(T0 + 1000, **fields)
    assert is_active(sample, Rule(), since=T0 + 500) == (active, reason)


def test_thresholds_come_from_the_rule():
    sample = quiet(T0, cpu_percent=30.0, gpu_percent=30.0)
    busy = is_active(sample, Rule(cpu_threshold=50, gpu_threshold=20), T0)
    assert busy == (True, "gpu 30% > 20%")
    assert is_active(sample, Rule(cpu_threshold=50, gpu_threshold=40), T0)[0] is False


# ---------------------------------------------------------------- transitions

R = {}  # default rule: idle_window 3600, warn_before 900, min_running 600
PARK = {"park_window": 1800}
CASES = [
    # name, status fields, sample fields, rule fields, now - T0, state, action
    ("busy kernel is active", {}, {"kernels_busy": 1}, R, 5000, State.active, None),
    ("cpu busy, gpu idle", {}, {"cpu_percent": 60}, R, 5000, State.active, None),
    ("gpu memory only", {}, {"gpu_memory_bytes": GIB}, R, 2000, State.idle, None),
    ("idle, before deadlines", {"state": State.active}, {}, R, 2000, State.idle, None),
    ("warn at idle_window - warn_before", {}, {}, R, 2700, State.warned, "warn"),
    ("warn only once", {"state": State.warned, "warned_at": T0 + 2700}, {}, R, 3000,
     State.warned, None),
    ("warned state alone counts as warned", {"state": State.warned, "state_since": T0 + 2700},
     {}, R, 3000, State.warned, None),
    ("suspend at idle_window", {"state": State.warned, "warned_at": T0 + 2700}, {}, R, 3600,
     State.suspending, "suspend"),
    ("stop rule stops", {"state": State.warned, "warned_at": T0 + 2700}, {},
     {"action": "stop"}, 3600, State.suspending, "stop"),
    ("no warning configured", {}, {}, {"warn_before": 0}, 3600, State.suspending, "suspend"),
    ("found past the deadline: warn first", {}, {}, R, 10_000, State.warned, "warn"),
    ("late warning delays suspension", {"state": State.warned, "warned_at": T0 + 10_000}, {}, R,
     10_500, State.warned, None),
    ("...until warn_before has passed", {"state": State.warned, "warned_at": T0 + 10_000}, {}, R,
     10_900, State.suspending, "suspend"),
    ("activity while warned", {"state": State.warned, "warned_at": T0 + 2700},
     {"gpu_percent": 50}, R, 3000, State.active, None),
    ("hub heartbeat is not activity", {"state": State.warned, "warned_at": T0 + 2700},
     {"hub_last_activity": T0 + 3599}, R, 3600, State.suspending, "suspend"),
    ("missing jupyter data never suspends", {"state": State.warned, "warned_at": T0 + 2700},
     {"errors": {"jupyter": "no answer within 10s"}}, R, 3600, State.active, None),
    # park tier
    ("park with gpu memory", {}, {"gpu_memory_bytes": 2 * GIB}, PARK, 1800, State.parked, "park"),
    ("no park without gpu memory", {}, {}, PARK, 1800, State.idle, None),
    ("no park when gpu memory unknown", {}, {"gpu_memory_bytes": None}, PARK, 1800, State.idle,
     None),
    ("park only once", {"state": State.parked}, {"gpu_memory_bytes": 0}, PARK, 2000,
     State.parked, None),
    ("parked server is warned, stays parked", {"state": State.parked}, {}, PARK, 2700,
     State.parked, "warn"),
    ("parked suspends without unparking", {"state": State.parked, "warned_at": T0 + 2700}, {},
     PARK, 3600, State.suspending, "suspend"),
    ("activity while parked unparks", {"state": State.parked}, {"kernels_busy": 1}, PARK, 2000,
     State.active, "unpark"),
    ("park after the warning", {"state": State.warned, "warned_at": T0 + 2700},
     {"gpu_memory_bytes": GIB}, {"park_window": 3000}, 3000, State.parked, "park"),
    # exemptions
    ("exempt rule", {}, {}, {"exempt": True}, 9000, State.exempt, None),
    ("action none", {}, {}, {"action": "none"}, 9000, State.exempt, None),
    ("exempt while parked unparks", {"state": State.parked}, {}, {"exempt": True}, 2000,
     State.exempt, "unpark"),
    ("exempted by an admin", {"exempt": True}, {}, R, 9000, State.exempt, None),
    ("exempted by an admin while parked unparks", {"state": State.parked, "exempt": True}, {},
     PARK, 2000, State.exempt, "unpark"),
    # states owned by the service and the spawner
    ("suspending left alone", {"state": State.suspending}, {"kernels_busy": 1}, R, 9000,
     State.suspending, None),
    ("suspended left alone", {"state": State.suspended}, {}, R, 9000, State.suspended, None),
    ("suspended and exempt left alone", {"state": State.suspended, "exempt": True}, {}, R, 9000,
     State.suspended, None),
    # failures
    ("failed waits for backoff", {"state": State.failed, "state_since": T0 + 3600,
     "warned_at": T0 + 2700}, {}, R, 5000, State.failed, None),
    ("failed retries after backoff", {"state": State.failed, "state_since": T0 + 3600,
     "warned_at": T0 + 2700}, {}, R, 7200, State.suspending, "suspend"),
    ("failed back to active on activity", {"state": State.failed, "state_since": T0 + 3600},
     {"cpu_percent": 99}, R, 4000, State.active, None),
    # minimum running time, keep requests
    ("younger than min_running", {}, {}, {"idle_window": 120, "warn_before": 0}, 300,
     State.idle, None),
    ("keep_until in the future", {"keep_until": T0 + 20_000}, {}, R, 10_000, State.active, None),
    ("keep_until in the future unparks", {"state": State.parked, "keep_until": T0 + 20_000}, {},
     PARK, 2000, State.active, "unpark"),
    ("keep_until passed", {"state": State.warned, "warned_at": T0 + 2700, "keep_until": T0 + 100},
     {}, R, 3600, State.suspending, "suspend"),
]  # fmt: skip


@pytest.mark.parametrize(
    "fields, sample, rule, dt, state, action", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_transition(fields, sample, rule, dt, state, action):
    d = decide(status(**fields), quiet(T0 + dt, **sample), Rule(**rule), T0 + dt)
    assert (d.state, d.action) == (state, action), d.reason


def test_idle_clock_restarts_after_restore():
    restored = T0 + 50_000
    st = status(state=State.active, restored_at=restored, warned_at=T0 + 2700, last_active=T0 + 10)
    d = decide(st, quiet(restored + 2000), Rule(), restored + 2000)
    assert (d.state, d.action, d.idle_seconds) == (State.idle, None, 2000)
    assert d.suspend_at == restored + 3600
    # the warning from before the suspension does not count again
    d = decide(st, quiet(restored + 2700), Rule(), restored + 2700)
    assert (d.state, d.action) == (State.warned, "warn")
    # a restored server is young again: no action inside min_running
    d = decide(st, quiet(restored + 100), Rule(idle_window=60, warn_before=0), restored + 100)
    assert (d.state, d.action) == (State.idle, None)


def test_deadlines_reported():
    d = decide(status(), quiet(T0 + 100), Rule(park_window=1200), T0 + 1000)
    assert (d.idle_seconds, d.warn_at, d.park_at, d.suspend_at) == (1000, T0 + 2700, T0 + 1200,
                                                                     T0 + 3600)  # fmt: skip
    # a warning that goes out late pushes suspension to warn_before after it
    d = decide(status(), quiet(T0 + 5000), Rule(), T0 + 5000)
    assert (d.action, d.suspend_at) == ("warn", T0 + 5000 + 900)


def test_last_active_is_when_activity_happened():
    st = status(last_active=T0 + 100)
    d = decide(st, quiet(T0 + 1000, jupyter_last_activity=T0 + 940), Rule(), T0 + 1000)
    assert (d.state, d.active, d.last_active, d.idle_seconds) == (State.active, True, T0 + 940, 60)
    d = decide(st, quiet(T0 + 1000, cpu_percent=50), Rule(), T0 + 1000)
    assert (d.last_active, d.reason) == (T0 + 1000, "cpu 50% > 10%")
    d = decide(st, quiet(T0 + 1000), Rule(), T0 + 1000)
    assert (d.active, d.last_active) == (False, T0 + 100)


def test_step_updates_the_status():
    st = status(state=State.idle, reason="kernel busy", keep_until=T0 + 5)
    new, d = step(st, quiet(T0 + 2700), Rule(name="gpu"), T0 + 2700)
    assert isinstance(d, Decision) and d.action == "warn"
    assert (new.state, new.state_since, new.warned_at) == (State.warned, T0 + 2700, T0 + 2700)
    assert (new.rule, new.reason, new.keep_until) == ("gpu", "kernel busy", None)
    assert new.last_sample["time"] == T0 + 2700 and st.state == State.idle  # input untouched
    again, d = step(new, quiet(T0 + 2800), Rule(name="gpu"), T0 + 2800)
    assert (d.action, again.state_since) == (None, T0 + 2700)
    active, d = step(again, quiet(T0 + 2900, kernels_busy=1), Rule(name="gpu"), T0 + 2900)
    assert (active.state, active.reason, active.last_active) == (State.active, "kernel busy",
                                                                 T0 + 2900)  # fmt: skip


@pytest.mark.parametrize(
    "rule, expected",
    [
        (Rule(), [(2700, "warn"), (3600, "suspend")]),
        (Rule(park_window=1800), [(1800, "park"), (2700, "warn"), (3600, "suspend")]),
        (Rule(park_window=3000), [(2700, "warn"), (3000, "park"), (3600, "suspend")]),
        (Rule(action="stop", warn_before=0), [(3600, "stop")]),
    ],
)
def test_each_action_once_over_a_quiet_hour(rule, expected):
    """Tick every minute over a quiet server holding GPU memory: each action comes exactly once."""
    st = status(state=State.active)
    seen = []
    for t in range(0, 4 * 3600, 60):
        if st.state == State.suspending:
            break
        st, d = step(st, quiet(T0 + t, gpu_memory_bytes=GIB), rule, T0 + t)
        if d.action:
            seen.append((t, d.action))
    assert seen == expected


# ---------------------------------------------------------------- rules and policy


def test_rule_matching_first_match_wins():
    policy = Policy.from_config(
        [
            {"name": "staff", "users": ["admin*", "ops-?"], "exempt": True},
            {"name": "gpu-students", "groups": ["students"], "profiles": ["gpu-*"]},
            {"name": "students", "groups": ["stud*"], "idle_window": 7200},
            {"name": "later-staff", "users": ["admin1"]},
        ],
        default={"idle_window": 1800, "warn_before": 300},
    )
    pick = lambda **kw: policy.rule_for(Server(**kw)).name  # noqa: E731
    assert pick(user="admin1", groups=["students"], profile="gpu-a100") == "staff"
    assert pick(user="ops-1") == "staff"
    assert pick(user="ops-12") == "default"
    assert pick(user="bob", groups=["x", "students"], profile="gpu-a100") == "gpu-students"
    assert pick(user="bob", groups=["students"], profile="cpu") == "students"  # all matchers needed
    assert pick(user="bob", groups=["students-2026"]) == "students"
    assert pick(user="carol") == "default"
    assert policy.default.idle_window == 1800
    assert Policy([]).rule_for(Server(user="x")) == Rule()


@pytest.mark.parametrize(
    "d, message",
    [
        ({"name": "gpu-students", "idle_window": "1h"},
         "rule 'gpu-students': idle_window must be a number of seconds > 0, got '1h'; write 3600"),
        ({"name": "r", "warn_before": "15m"}, "warn_before must be a number of seconds >= 0, got "
         "'15m'; write 900"),
        ({"name": "r", "idle_window": -5}, "rule 'r': idle_window must be a number of seconds > 0"),
        ({"name": "r", "min_running": -1}, "rule 'r': min_running must be a number of seconds >= 0"),
        ({"name": "r", "idle_window": True}, "idle_window must be a number of seconds > 0, got True"),
        ({"name": "r", "cpu_threshold": "high"}, "cpu_threshold must be a number of percent >= 0"),
        ({"name": "r", "idel_window": 60}, "rule 'r': unknown key 'idel_window'; did you mean "
         "'idle_window'?"),
        ({"name": "r", "zzz": 1}, "unknown key 'zzz'; known keys: name, users"),
        ({"name": "r", "park_window": 3600},
         "rule 'r': park_window (3600) must be less than idle_window (3600); lower park_window"),
        ({"name": "r", "park_window": "30m"}, "park_window must be a number of seconds > 0 or "
         "null, got '30m'; write 1800"),
        ({"name": "r", "warn_before": 4000}, "rule 'r': warn_before (4000) must be less than "
         "idle_window (3600)"),
        ({"name": "r", "action": "kill"}, "rule 'r': action must be one of suspend, stop, none, "
         "got 'kill'"),
        ({"name": "r", "users": "alice"}, "rule 'r': users must be a list of glob patterns, got "
         "'alice'; write ['alice']"),
        ({"name": "r", "groups": [1]}, "rule 'r': groups must be a list of glob patterns"),
        ({"name": "r", "exempt": "yes"}, "rule 'r': exempt must be true or false, got 'yes'"),
        ({"name": ""}, "rule name must be a non-empty string"),
        ({"idle_window": 0}, "rule 'rules[0]': idle_window must be a number of seconds > 0"),
        ("idle", "rule 'rules[0]' must be a mapping of keys, got 'idle'"),
    ],
)  # fmt: skip
def test_rule_validation_messages(d, message):
    with pytest.raises(ValueError) as e:
        Policy.from_config([d])
    assert message in str(e.value)


def test_rule_from_dict_keeps_values():
    r = Rule.from_dict({"name": "x", "users": ("a*",), "park_window": 60, "warn_before": 0})
    assert dataclasses.asdict(r) == {**dataclasses.asdict(Rule()), "name": "x", "users": ["a*"],
                                     "park_window": 60, "warn_before": 0}  # fmt: skip


def test_duplicate_rule_names_refused():
    with pytest.raises(ValueError, match=r"rename the rules named \['a'\]"):
        Policy.from_config([{"name": "a"}, {"name": "a", "users": ["b"]}])


# ---------------------------------------------------------------- keep requests


def test_clamp_keep():
    rule = Rule(max_keep_running=8 * 3600)
    assert clamp_keep(T0 + 3600, T0, rule) == T0 + 3600
    assert clamp_keep(T0 + 3 * 86400, T0, rule) == T0 + 8 * 3600
    assert clamp_keep(int(T0) + 60, T0, rule) == T0 + 60
    with pytest.raises(ValueError, match="is in the past; choose a later time"):
        clamp_keep(T0 - 1, T0, rule)
    with pytest.raises(ValueError, match="is in the past"):
        clamp_keep(T0, T0, rule)
    for bad in ("tomorrow", None, True, [T0]):
        with pytest.raises(ValueError, match="must be a number of seconds since the epoch"):
            clamp_keep(bad, T0, rule)
