"""The watcher carries out what the policy decided, through its one executor: a tick's park
and warning, and an admin's exemption (asked through the service facade) unparking a parked
server. The Hub and the signals are fakes; the clock is the one thing moved."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timezone
from types import SimpleNamespace

from jupyterhub_gpusnap.model import Sample, Server, State
from jupyterhub_gpusnap.policy import Policy, Rule
from jupyterhub_gpusnap.service import Service
from jupyterhub_gpusnap.store import Store
from jupyterhub_gpusnap.watcher import Watcher

T = 1_800_000_000.0
GIB = 1 << 30
log = logging.getLogger("test")


class Hub:
    def __init__(self, servers: list[Server]):
        self.servers = servers

    async def list_servers(self) -> list[Server]:
        return list(self.servers)


class QuietGpu:
    """Every server quiet, holding GPU memory."""

    name = "fake"
    concurrency = 1

    async def sample(self, server: Server, now: float) -> Sample:
        return Sample(time=now, kernels=1, kernels_busy=0, cpu_percent=0.0, gpu_percent=0.0,
                      gpu_memory_bytes=2 * GIB)  # fmt: skip


async def test_a_tick_parks_and_warns_and_an_exemption_unparks(tmp_path):
    clock = [T]
    alice = Server(
        user="alice", started=datetime.fromtimestamp(T - 2000, timezone.utc), state={"pid": 1}
    )
    store = Store(f"sqlite:///{tmp_path}/gpusnap.sqlite")
    policy = Policy([], Rule(park_window=1800, min_running=0))
    watcher = Watcher(hub=Hub([alice]), store=store, policy=policy, sources=[QuietGpu()], backend=None,
                      clock=lambda: clock[0], log=log)  # fmt: skip
    service = Service(watcher, store, policy, clock=lambda: clock[0])
    calls = []

    async def park(server, status, unpark=False, reason="", detail=None):
        calls.append(("unpark" if unpark else "park", server.key, status.state))
        return SimpleNamespace(bytes_moved=2 * GIB)

    watcher.room.park = park

    await watcher.tick()  # idle 2000 s >= park_window
    assert calls == [("park", "alice/", State.parked)]
    assert store.get("alice/").state == State.parked

    clock[0] = T + 800  # idle 2800 s: the warning, 900 s before idle_window; stays parked
    await watcher.tick()
    assert store.get("alice/").state == State.parked
    kinds = [e["kind"] for e in store.events("alice/")]
    assert kinds.count("warn") == 1 and len(calls) == 1, (kinds, calls)

    status = service.exempt("alice/", True, by="ada")
    assert (status.state, status.exempt, status.reason) == (State.exempt, True, "exempted by ada")
    await asyncio.gather(*watcher._background)
    assert calls[-1] == ("unpark", "alice/", State.exempt)
    [moved] = [e["detail"] for e in store.events("alice/") if e["kind"] == "state"][:1]
    assert (moved["from"], moved["to"]) == ("parked", "exempt")
    assert service.model(store.get("alice/"))["exempt"] is True

    clock[0] = T + 9000  # long past every deadline: exempt, nothing done
    await watcher.tick()
    assert store.get("alice/").state == State.exempt and len(calls) == 2

    status = service.exempt("alice/", False, by="ada")
    assert (status.state, status.exempt) == (State.active, False)
    assert service.model(store.get("alice/"))["exempt"] is False
    store.close()


class Snapshots:
    """The backend's word on alice's snapshot c1 (``get`` only: all the watcher asks here)."""

    def __init__(self, status: str, error: str = ""):
        self.status, self.error = status, error

    async def get(self, cid: str):
        return SimpleNamespace(id=cid, status=self.status, error=self.error, image_bytes=5 * GIB,
                               gpu_bytes=2 * GIB, extra={"retention_days": 30})  # fmt: skip


async def test_a_restored_server_gone_because_its_restore_could_not_finish_is_a_failed_restore(
    tmp_path,
):
    """A lazy restore hands the server out, then cannot bring all of it back (a damaged page,
    its GPU memory): the backend stops the server and fails the snapshot. The watcher sees
    the server gone and records, counts and tells a failed restore (the user's email says
    the snapshot is kept), not a stop; a restored server the user stopped stays a stop."""
    from jupyterhub_gpusnap import metrics
    from jupyterhub_gpusnap.policy import ServerStatus

    why = "lazy restore failed after the server ran: pages-1.img: the 64 KiB block at offset 0 (damaged)"
    for backend, failed in ((Snapshots("failed", why), True), (Snapshots("restored"), False)):
        store = Store(f"sqlite:///{tmp_path}/gpusnap-{failed}.sqlite")
        store.put(ServerStatus(key="alice/", user="alice", name="", state=State.active, state_since=T,
                               last_active=T, started=T, restored_at=T, checkpoint_id="c1"))  # fmt: skip
        watcher = Watcher(hub=Hub([]), store=store, policy=Policy([], Rule()), sources=[QuietGpu()],
                          backend=backend, clock=lambda: T + 60, log=log)  # fmt: skip
        told: list = []

        async def notify(kind, status, event_id, detail, told=told, **kw):
            told.append((kind, detail))

        watcher._notify = notify
        before = metrics.FAILURES.labels(kind="restore")._value.get()
        await watcher.tick()
        assert store.get("alice/") is None  # gone: not suspended, nothing left to watch
        kinds = [e["kind"] for e in store.events("alice/")]
        after = metrics.FAILURES.labels(kind="restore")._value.get()
        if failed:
            assert kinds == ["restore_failed"], kinds
            [event] = [e for e in store.events("alice/") if e["kind"] == "restore_failed"]
            assert event["detail"]["error"] == why and event["detail"]["checkpoint"] == "c1"
            assert [k for k, _ in told] == ["restore_failed"] and told[0][1]["retention_days"] == 30
            assert after == before + 1
        else:
            assert "restore_failed" not in kinds and told == [] and after == before, (kinds, told)


async def test_a_suspended_server_is_not_running_before_the_next_tick_says_so(tmp_path):
    """Right after a suspension the last tick's list of the Hub's servers still holds the
    server; its model must say it is not running (the Lab panel shows "suspended at …,
    your kernels are saved" from it, not "server not running")."""
    from jupyterhub_gpusnap.policy import ServerStatus

    alice = Server(
        user="alice", started=datetime.fromtimestamp(T - 100, timezone.utc), state={"pid": 1}
    )
    store = Store(f"sqlite:///{tmp_path}/gpusnap.sqlite")
    policy = Policy([], Rule())
    watcher = Watcher(hub=Hub([alice]), store=store, policy=policy, sources=[QuietGpu()], backend=None,
                      clock=lambda: T, log=log)  # fmt: skip
    watcher.servers = {alice.key: alice}  # the last tick's list
    service = Service(watcher, store, policy, clock=lambda: T)
    running = ServerStatus(key="alice/", user="alice", name="", state=State.idle, state_since=T,
                           last_active=T, started=T)  # fmt: skip
    assert service.model(running)["running"] is True
    suspended = ServerStatus(key="alice/", user="alice", name="", state=State.suspended,
                             state_since=T, last_active=T, started=T, checkpoint_id="c1")  # fmt: skip
    model = service.model(suspended)
    assert model["running"] is False and model["url"] is None, model


async def test_a_ticks_state_change_goes_through_the_executor_held_with_the_ticks_rows(tmp_path):
    """A tick's own state change is an effect the executor carries out, as an event's is: the
    policy's ``state`` record, written with the tick's rows (one write per tick), not at once."""
    clock = [T]
    alice = Server(
        user="alice", started=datetime.fromtimestamp(T - 3200, timezone.utc), state={"pid": 1}
    )
    store = Store(f"sqlite:///{tmp_path}/gpusnap.sqlite")
    policy = Policy([], Rule(idle_window=3600, warn_before=600, min_running=0))
    watcher = Watcher(hub=Hub([alice]), store=store, policy=policy, sources=[QuietGpu()], backend=None,
                      clock=lambda: clock[0], log=log)  # fmt: skip
    executed, at_once = [], []
    execute, record_event = watcher._execute, store.record_event

    def spy_execute(status, was, effects, *args, **kw):
        executed.append((was, [(e.action, e.kind) for e in effects], kw.get("batch", False)))
        return execute(status, was, effects, *args, **kw)

    def spy_record_event(key, kind, *args, **kw):
        at_once.append(kind)
        return record_event(key, kind, *args, **kw)

    async def warn(status, decision):
        pass

    watcher._execute, store.record_event, watcher._warn = spy_execute, spy_record_event, warn

    await watcher.tick()  # new: active; idle 3200 s >= idle_window - warn_before: warned
    assert store.get("alice/").state == State.warned
    assert executed == [(State.active, [("record", "state"), ("warn", "")], True)]
    assert at_once == []  # held with the tick's rows
    [moved] = [e["detail"] for e in store.events("alice/") if e["kind"] == "state"]
    assert (moved["from"], moved["to"]) == ("active", "warned")

    clock[0] = T + 60  # still warned: nothing to record or do
    await watcher.tick()
    assert len(executed) == 1 and at_once == []
    assert [e["kind"] for e in store.events("alice/")].count("state") == 1
    store.close()
