"""The service's database, on real SQLite: files on disk and in memory."""

from __future__ import annotations

import stat
import threading
import time

import pytest

from jupyterhub_gpusnap.model import State
from jupyterhub_gpusnap.policy import ServerStatus
from jupyterhub_gpusnap.store import Store

T0 = 1_800_000_000.0


def full_status(key: str = "alice/gpu", **kw) -> ServerStatus:
    """A status with every field set to a non-default value."""
    user, _, name = key.partition("/")
    values = dict(
        key=key,
        user=user,
        name=name,
        state=State.warned,
        state_since=T0 + 2700.5,
        last_active=T0 + 12.25,
        started=T0,
        keep_until=T0 + 9000,
        restored_at=T0 - 50,
        rule="gpu-students",
        reason="cpu 87% > 10%",
        checkpoint_id="alice-gpu-20270115T080000Z",
        failure="criu dump: Can't dump socket; see docs/troubleshoot.md",
        failures=2,
        last_sample={"time": T0 + 2700.5, "gpu_memory_bytes": 2 << 30, "errors": {"gpu": "x"}},
        warned_at=T0 + 2700.5,
    )
    values.update(kw)
    return ServerStatus(**values)


@pytest.fixture
def store():
    s = Store("sqlite://")
    yield s
    s.close()


def test_in_memory_round_trip(store):
    st = full_status()
    assert store.get(st.key) is None
    store.put(st)
    assert store.get(st.key) == st
    assert isinstance(store.get(st.key).state, State)
    # replace, not duplicate
    st2 = full_status(state=State.suspended, keep_until=None, warned_at=None, last_sample={})
    store.put(st2)
    assert store.get(st.key) == st2
    assert store.all() == [st2]


def test_defaults_round_trip(store):
    st = ServerStatus(key="bob/", user="bob")
    store.put(st)
    assert store.get("bob/") == st


def test_all_delete_and_counts(store):
    for key, state in [("a/", State.active), ("b/", State.idle), ("c/x", State.idle)]:
        store.put(full_status(key, state=state))
    assert [s.key for s in store.all()] == ["a/", "b/", "c/x"]
    counts = store.counts_by_state()
    assert counts == {**{s.value: 0 for s in State}, "active": 1, "idle": 2}
    store.delete("b/")
    store.delete("nobody/")  # deleting what is not there is fine
    assert store.get("b/") is None
    assert [s.key for s in store.all()] == ["a/", "c/x"]
    assert store.counts_by_state()["idle"] == 1


def test_events_newest_first_with_limit_and_key(store):
    ids = []
    for i in range(5):
        ids.append(store.record_event("alice/", "state", {"to": f"s{i}"}, now=T0 + i))
        ids.append(store.record_event("bob/", "warn", {"n": i}, now=T0 + i))
    assert ids == sorted(ids) and len(set(ids)) == 10
    ev = store.events()
    assert [e["id"] for e in ev] == ids[::-1]
    assert ev[0] == {"id": ids[-1], "time": T0 + 4, "key": "bob/", "kind": "warn",
                     "detail": {"n": 4}}  # fmt: skip
    alice = store.events("alice/", limit=2)
    assert [e["detail"]["to"] for e in alice] == ["s4", "s3"]
    assert {e["key"] for e in store.events("alice/")} == {"alice/"}
    assert len(store.events(limit=3)) == 3
    assert store.events("nobody/") == []


def test_event_time_defaults_to_now(store):
    before = time.time()
    store.record_event("alice/", "suspend_failed", {"error": "disk full"})
    (e,) = store.events()
    assert before <= e["time"] <= time.time()
    assert e["detail"] == {"error": "disk full"}


def test_notification_idempotence(store):
    assert store.notification_sent("alice/", "warn", 7) is False
    assert store.record_notification("alice/", "warn", 7) is True
    assert store.record_notification("alice/", "warn", "7") is False  # same ref, int or str
    assert store.notification_sent("alice/", "warn", 7) is True
    # another kind, key or event is another notification
    assert store.record_notification("alice/", "suspended", 7) is True
    assert store.record_notification("bob/", "warn", 7) is True
    assert store.record_notification("alice/", "warn", 8) is True
    # a failed send gives the claim back
    store.release_notification("alice/", "warn", 7)
    assert store.notification_sent("alice/", "warn", 7) is False
    assert store.record_notification("alice/", "warn", 7) is True


def test_racing_senders_send_once(tmp_path):
    """Two stores on one file, many threads claiming the same notification: one wins."""
    url = f"sqlite:///{tmp_path / 'race.sqlite'}"
    stores = [Store(url), Store(url)]
    results = []
    barrier = threading.Barrier(8)

    def claim(s: Store):
        barrier.wait()
        results.append(s.record_notification("alice/", "warn", 1))

    threads = [threading.Thread(target=claim, args=(stores[i % 2],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 7 + [True]
    for s in stores:
        s.close()


def test_file_survives_reopen_and_is_private(tmp_path):
    path = tmp_path / "gpusnap.sqlite"
    url = f"sqlite:///{path}"
    statuses = [full_status("alice/gpu"), full_status("bob/", state=State.failed, failures=7)]
    with Store(url) as s:
        for st in statuses:
            s.put(st)
        eid = s.record_event("alice/gpu", "suspend", {"checkpoint": "c1", "bytes": 123}, now=T0)
        s.record_notification("alice/gpu", "suspended", eid)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with Store(url) as s:
        assert s.all() == statuses
        assert s.get("bob/") == statuses[1]
        assert s.events() == [{"id": eid, "time": T0, "key": "alice/gpu", "kind": "suspend",
                               "detail": {"checkpoint": "c1", "bytes": 123}}]  # fmt: skip
        assert s.notification_sent("alice/gpu", "suspended", eid) is True
        assert s.record_notification("alice/gpu", "suspended", eid) is False
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_missing_folder_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match="folder .*nowhere does not exist; create it"):
        Store(f"sqlite:///{tmp_path / 'nowhere' / 'db.sqlite'}")


def test_in_memory_stores_are_separate():
    with Store("sqlite://") as a, Store("sqlite://") as b:
        a.put(full_status())
        assert b.get("alice/gpu") is None and a.get("alice/gpu") is not None
