"""The service's database, on real SQLite: files on disk and in memory."""

from __future__ import annotations

import dataclasses
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


def test_put_many_inserts_and_replaces_in_one_go(store):
    store.put(full_status("a/", state=State.idle))
    batch = [
        full_status("a/", state=State.active, failures=0),
        full_status("b/x"),
        ServerStatus(key="c/", user="c"),
    ]
    store.put_many(batch)
    assert store.all() == sorted(batch, key=lambda s: s.key)
    store.put_many([])  # nothing to write is fine
    assert len(store.all()) == 3


def test_batch_holds_writes_until_it_ends(tmp_path):
    """Inside a batch this store sees its held writes; another connection sees them at the end."""
    url = f"sqlite:///{tmp_path / 'batch.sqlite'}"
    with Store(url) as a, Store(url) as other:
        old = full_status("a/", state=State.idle)
        a.put(old)
        new_a = full_status("a/", state=State.active, reason="busy kernel")
        new_b = full_status("b/")
        with a.batch(preload=True):
            a.put(new_a)
            a.put(new_b)
            assert a.get("a/") == new_a and a.get("b/") == new_b  # read your writes
            assert [s.key for s in a.all()] == ["a/", "b/"]
            assert other.get("a/") == old and other.get("b/") is None  # not written yet
            with a.batch():  # nested: joins the outer batch
                a.put(full_status("c/"))
            assert other.get("c/") is None
        assert other.get("a/") == new_a and other.get("b/") == new_b
        assert [s.key for s in other.all()] == ["a/", "b/", "c/"]


def test_batch_now_writes_and_deletes_at_once(tmp_path):
    url = f"sqlite:///{tmp_path / 'batch.sqlite'}"
    with Store(url) as a, Store(url) as other:
        a.put(full_status("gone/"))
        with a.batch(preload=True):
            a.put(full_status("a/", state=State.warned))
            suspending = full_status("a/", state=State.suspending)
            a.put(suspending, now=True)  # replaces the held write, written at once
            assert other.get("a/") == suspending and a.get("a/") == suspending
            a.put(full_status("gone/", state=State.idle))
            a.delete("gone/")
            assert a.get("gone/") is None and other.get("gone/") is None
        assert other.get("a/") == suspending  # the older held write did not come back
        assert other.get("gone/") is None


def test_batch_writes_even_when_the_block_fails(store):
    with pytest.raises(RuntimeError):
        with store.batch():
            store.put(full_status("a/"))
            raise RuntimeError("a tick failed half-way")
    assert store.get("a/") == full_status("a/")
    # the returned status is a copy: changing it changes nothing stored
    st = store.get("a/")
    with store.batch(preload=True):
        got = store.get("a/")
        got.last_sample["x"] = 1
        assert store.get("a/").last_sample == st.last_sample


def test_keys_lists_stored_and_held_rows(store):
    store.put(full_status("b/"))
    with store.batch():
        store.put(full_status("a/x"))
        assert store.keys() == ["a/x", "b/"]
    store.delete("b/")
    assert store.keys() == ["a/x"]


def test_batches_write_what_changed_and_keep_the_order_of_events(tmp_path):
    """A preloading batch updates only changed columns, against rows it keeps between batches."""
    url = f"sqlite:///{tmp_path / 'batch.sqlite'}"
    with Store(url) as a, Store(url) as other:
        alice, bob = full_status("alice/"), full_status("bob/", state=State.idle)
        with a.batch(preload=True):
            a.put(alice)
            a.put(bob)
        assert other.get("alice/") == alice and other.get("bob/") == bob
        later = dataclasses.replace(
            alice,
            state=State.warned,
            last_sample={"time": T0 + 60, "errors": {"jupyter": "timeout"}},
        )
        with a.batch(preload=True):
            a.put(later)
            a.put(bob)  # unchanged
            a.add_event("alice/", "state", {"to": "warned"}, now=T0)
            warn = a.record_event("alice/", "warn", {}, now=T0)  # written now: the held one first
            a.add_event("bob/", "state", {"to": "idle"}, now=T0)
            assert [e["kind"] for e in a.events(limit=3)] == ["state", "warn", "state"]
            assert other.get("alice/") == alice  # the rows are held until the end
        assert other.get("alice/") == later and other.get("bob/") == bob
        kinds = [(e["key"], e["kind"]) for e in reversed(other.events())]
        assert kinds == [("alice/", "state"), ("alice/", "warn"), ("bob/", "state")]
        assert other.events()[1]["id"] == warn
        # what the store kept between batches is what the database holds
        with a.batch(preload=True):
            assert a.get("alice/") == other.get("alice/") and a.get("bob/") == other.get("bob/")
        a.delete("bob/")
        with a.batch(preload=True):
            assert a.get("bob/") is None and a.keep_until("bob/", missing=-1.0) == -1.0
