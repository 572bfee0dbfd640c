"""User interaction in JupyterLab as a signal of its own, with its own window in the policy."""

from __future__ import annotations

import pytest

from jupyterhub_gpusnap.model import State
from jupyterhub_gpusnap.policy import Rule, decide, step
from jupyterhub_gpusnap.signals.interaction import InteractionLog
from tests.helpers.policy_samples import T0, quiet, status

RULE = Rule(idle_window=3600, warn_before=600, min_running=0, interaction_window=1800)


def test_an_untouched_tab_reports_nothing_and_the_server_is_suspended_on_time():
    d = decide(status(state=State.warned, warned_at=T0 + 3000), quiet(T0 + 3600), RULE, T0 + 3600)
    assert (d.state, d.action) == (State.suspending, "suspend")


def test_a_new_interaction_counts_as_use_without_moving_the_kernels_clock():
    now = T0 + 3000
    d = decide(status(), quiet(now, last_interaction=now - 20), RULE, now)
    assert (d.state, d.reason, d.action) == (State.active, "JupyterLab in use", None)
    assert d.last_active == T0  # "Last active" stays the kernels' time
    assert d.idle_since == now - 20


def test_interaction_holds_off_the_suspension_for_interaction_window():
    touch = T0 + 3000
    s = status(last_sample={"last_interaction": touch})  # already seen: no longer "new"
    d = decide(s, quiet(T0 + 3700, last_interaction=touch), RULE, T0 + 3700)
    assert (d.state, d.action) == (State.idle, None)  # not suspended at T0 + idle_window
    assert d.suspend_at == touch + 1800 and d.idle_seconds == 700
    d = decide(s, quiet(touch + 1200, last_interaction=touch), RULE, touch + 1200)
    assert (d.state, d.action) == (State.warned, "warn")  # warn_before ahead of the new deadline
    warned = status(
        state=State.warned, warned_at=touch + 1200, last_sample={"last_interaction": touch}
    )
    d = decide(warned, quiet(touch + 1800, last_interaction=touch), RULE, touch + 1800)
    assert (d.state, d.action) == (State.suspending, "suspend")


def test_a_short_interaction_window_never_shortens_the_idle_window():
    rule = Rule(idle_window=3600, warn_before=600, min_running=0, interaction_window=60)
    s = status(last_sample={"last_interaction": T0 + 100})
    d = decide(s, quiet(T0 + 1000, last_interaction=T0 + 100), rule, T0 + 1000)
    assert d.suspend_at == T0 + 3600


def test_interaction_window_0_ignores_interaction():
    rule = Rule(idle_window=3600, warn_before=600, min_running=0, interaction_window=0)
    d = decide(status(), quiet(T0 + 3000, last_interaction=T0 + 2990), rule, T0 + 3000)
    assert d.state == State.warned and d.suspend_at == T0 + 3600


def test_interaction_window_defaults_to_idle_window_and_is_validated():
    assert Rule(idle_window=1234, warn_before=0).interaction_seconds == 1234
    with pytest.raises(ValueError, match="interaction_window must be a number of seconds >= 0"):
        Rule.from_dict({"interaction_window": -1})
    with pytest.raises(ValueError, match="write 900"):
        Rule.from_dict({"interaction_window": "15m"})


def test_the_sample_remembers_the_interaction_seen_so_the_next_tick_is_idle_again():
    now = T0 + 3000
    new, d = step(status(), quiet(now, last_interaction=now - 5), RULE, now)
    assert d.state == State.active and new.last_sample["last_interaction"] == now - 5
    _, d = step(new, quiet(now + 60, last_interaction=now - 5), RULE, now + 60)
    assert d.state == State.idle and d.idle_seconds == 65


def test_the_log_keeps_the_newest_time_and_the_stored_one_after_a_restart():
    log = InteractionLog()
    assert log.get("alice/", stored=T0) == T0  # after a restart: the database's copy
    log.record("alice/", T0 + 10)
    log.record("alice/", T0 + 5)  # out of order: the newest stays
    assert log.get("alice/", stored=T0) == T0 + 10
    log.forget("alice/")
    assert log.get("alice/") is None
