"""The service's loop: each tick lists servers, reads their signals, applies the policy, acts.

The policy decides every state change (:mod:`.policy`: ``step`` for a tick's sample,
``transition`` for everything else); the watcher persists what it returns and carries out
its effects in one executor (a tick's actions, and events through :meth:`Watcher.execute`),
parking and making room through :class:`~.room.Room`. Handlers reach it only through
:class:`~.service.Service`. The watcher owns *when*; checkpoint backends own *how*. A server is stopped only
after its backend returned a verified checkpoint; every failure leaves it running,
is logged, counted in metrics and recorded as an event the admin page shows.
"""

from __future__ import annotations

import asyncio
import gc
import math
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager

from traitlets import Float, Integer
from traitlets.config import LoggingConfigurable

from . import metrics
from .checkpoint.base import CheckpointBackend, CheckpointError, CheckpointRefused
from .checkpoint.lazy import UNFINISHED
from .hub import HubClient, HubError
from .model import Sample, Server, State
from .policy import (
    Decision,
    Effect,
    Event,
    Policy,
    ServerStatus,
    clamp_keep,
    step,
    tick_effects,
    transition,
)
from .room import Room
from .signals.base import SignalSource
from .signals.interaction import InteractionLog
from .store import Store

# States in which a server is not running and the watcher keeps its record.
OFFLINE = {State.suspended, State.suspending}
# Seconds a finished suspension waits for its "suspended" email to be claimed in the store
# (address looked up, claim written; the sending runs in the background) before it records the
# server suspended: the claim first keeps a crash in between from mailing the user twice.
CLAIM_TIMEOUT = 30.0
# Sample fields exported as gpusnap_signal{signal=...}, in Watcher._export's order.
_EXPORTED_SIGNALS = ("cpu", "gpu", "gpu_memory", "kernels_busy")


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Automatic garbage collection off for a tick, back on after it.

    A tick over thousands of servers allocates a few hundred thousand objects, nearly all
    freed by reference counting as they go. With collection on, every 700 allocations
    start a collection, and every tick or two a full one walks every object the service
    keeps (a metric child and a stored row per server: hundreds of thousands), which cost
    a third of the tick's CPU. Cycles made meanwhile are collected after the tick, as usual.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _restamped(part: Sample, now: float) -> Sample:
    """``Sample(time=now).merge(part)`` for a sample with nothing else set: a copy, cheaper."""
    sample = object.__new__(Sample)
    sample.__dict__.update(part.__dict__)
    sample.time, sample.errors = now, dict(part.errors)
    return sample


class Watcher(LoggingConfigurable):
    """Applies the policy to every running server once per tick."""

    suspend_concurrency = Integer(
        2,
        help="Suspensions (checkpoint + stop) running at the same time. Each one writes "
        "the server's memory to disk; raise it on hosts with fast disks and many GPUs.",
    ).tag(config=True)

    suspend_timeout = Float(
        1800,
        help="Seconds one suspension may take before it is given up (the server keeps running).",
    ).tag(config=True)

    min_free_gpu_memory = Integer(
        0,
        min=0,
        help="""Bytes of memory to keep free on each GPU; 0 (the default) turns it off.
        Each tick, on a GPU with less free memory than this, the service parks servers
        holding memory on that GPU, the longest idle first, until the GPU has this much
        free (the same make-room as the admin API, POST api/make-room). Only servers idle
        by every signal for at least min_free_gpu_memory_idle are parked; active, busy,
        exempt and kept-running servers never are. For GPUs shared by several servers,
        e.g. 17179869184 (16 GiB) keeps room for an inference service. On Kubernetes
        (KubernetesBackend) the node agents read their GPUs (GET /v1/gpus) and the floor
        holds for each GPU of each node, parking only servers on that GPU of that node.
        Needs NVML and a driver with the CUDA checkpoint API (570+) where the GPUs are;
        without them it does nothing.""",
    ).tag(config=True)

    min_free_gpu_memory_idle = Float(
        300,
        min=0,
        help="""Seconds a server must have been idle by every signal before
        min_free_gpu_memory may park it (default 5 minutes), so that a user who just
        paused is not parked at once. Independent of the rules' park_window, which parks
        idle servers whether or not their GPU is short of memory.""",
    ).tag(config=True)

    def __init__(
        self,
        hub: HubClient,
        store: Store,
        policy: Policy,
        sources: list[SignalSource],
        backend: CheckpointBackend | None,
        notifier=None,
        clock: Callable[[], float] = time.time,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.hub = hub
        self.store = store
        self.policy = policy
        self.sources = sources
        self.backend = backend
        self.notifier = notifier
        self.clock = clock
        self.interactions = InteractionLog()  # pushed by the Lab extension (POST .../interaction)
        self.servers: dict[str, Server] = {}  # running servers seen by the last tick
        self.samples: dict[str, Sample] = {}
        self.decisions: dict[str, Decision] = {}
        self._inflight: dict[str, asyncio.Task] = {}
        self._due: list[tuple[float, str, Server, bool, str]] = []  # suspensions decided this tick
        self._gauges: dict[str, dict] = {}  # per-server metric children (see _gauge)
        self._exported: dict[str, tuple] = {}  # per-server values last set on them
        self._semaphore = asyncio.Semaphore(self.suspend_concurrency)
        self._background: set[asyncio.Task] = set()  # unparks an exemption started
        self.room = Room(self)  # parks and unparks; makes room on GPUs
        self.ticks = 0

    # ----------------------------------------------------------------- the tick
    async def tick(self) -> None:
        """List the running servers, read their signals, apply the policy, act; once."""
        with _gc_paused():
            await self._tick()

    async def _tick(self) -> None:
        start = time.perf_counter()
        try:
            servers = await self.hub.list_servers()
        except (HubError, OSError) as e:
            metrics.FAILURES.labels(kind="hub").inc()
            self.log.error("Listing servers failed, skipping this tick: %s", e)
            return
        now = self.clock()
        running = {s.key: s for s in servers}
        self.servers = running
        for source in self.sources:
            prefetch = getattr(source, "prefetch", None)
            if prefetch:
                try:
                    await prefetch(servers)
                except Exception as e:  # a broken prefetch just means per-server reads
                    self.log.warning("signal %s prefetch failed: %s", source.name, e)
        # one read and one commit per tick instead of one of each per server
        with self.store.batch(preload=True):
            watched = [s for s in servers if s.key not in self._inflight]
            samples = await self.read_all(watched, now)
            await self.apply(watched, samples, now)
            await self.room.keep_gpu_free()
        await self._reconcile_gone(running, now)
        metrics.set_state_counts(self.store.counts_by_state())
        self.ticks += 1
        metrics.LOOP_SECONDS.observe(time.perf_counter() - start)

    async def read_signals(self, server: Server, now: float) -> Sample:
        """One server's sample from every source (later sources win)."""
        return (await self.read_all([server], now))[server.key]

    async def read_all(self, servers: list[Server], now: float) -> dict[str, Sample]:
        """Every server's sample, by key: the Hub's view merged with each source's reading.

        Each source reads with as many workers as its ``concurrency`` allows, sources side
        by side: the same parallelism as a task per server, without creating 10,000 tasks
        (and semaphore waits) per tick.
        """
        keys = [s.key for s in servers]
        hub = [s.last_activity.timestamp() if s.last_activity else None for s in servers]
        if not servers or not self.sources:
            return {
                k: Sample(time=now, hub_last_activity=h) for k, h in zip(keys, hub, strict=True)
            }
        parts = await asyncio.gather(
            *(self._read_source(src, servers, now) for src in self.sources)
        )
        samples: dict[str, Sample] = {}
        errors = 0
        # the usual case: the source's own sample, restamped, with the Hub's view
        if len(parts) == 1:
            for key, last, part in zip(keys, hub, parts[0], strict=True):
                sample = samples[key] = _restamped(part, now)
                if sample.hub_last_activity is None:
                    sample.hub_last_activity = last
                errors += len(sample.errors)
        else:
            for i, key in enumerate(keys):
                sample = samples[key] = Sample(time=now, hub_last_activity=hub[i])
                for results in parts:
                    sample.merge(results[i])
                errors += len(sample.errors)
        if errors:
            metrics.FAILURES.labels(kind="signal").inc(errors)
        return samples

    @staticmethod
    async def _read_source(source: SignalSource, servers: list[Server], now: float) -> list[Sample]:
        """``source``'s sample of each of ``servers`` (same order), ``concurrency`` at a time."""
        results: list[Sample] = [None] * len(servers)  # type: ignore[list-item]
        todo = iter(enumerate(servers))

        async def worker() -> None:
            for i, server in todo:  # one shared iterator: each server is read once
                results[i] = await source.sample(server, now)

        workers = max(1, min(source.concurrency, len(servers)))
        if workers == 1:
            await worker()
        else:
            await asyncio.gather(*(worker() for _ in range(workers)))
        return results

    def new_status(self, server: Server, now: float) -> ServerStatus:
        started = server.started.timestamp() if server.started else now
        return ServerStatus(
            key=server.key,
            user=server.user,
            name=server.name,
            state=State.active,
            state_since=now,
            last_active=started,
            started=started,
        )

    async def watch_server(self, server: Server, now: float) -> None:
        """One tick for one server: read its signals, apply the policy, act."""
        if server.key in self._inflight:
            return  # a suspension of this server is under way
        await self.apply([server], await self.read_all([server], now), now)

    async def apply(self, servers: list[Server], samples: dict[str, Sample], now: float) -> None:
        """Apply the policy to each server's fresh sample; store, export and act on the decisions."""
        statuses: dict[str, ServerStatus] = {}
        returned, interrupted = [], []
        keys = [s.key for s in servers]
        for key, server in zip(keys, servers, strict=True):
            if key in self._inflight:
                continue  # a suspension started while the signals were read
            status = self.store.get(key)
            if status is None:
                status = self.new_status(server, now)
            elif status.state == State.suspending:
                interrupted.append((status, server))  # not in flight: a crash interrupted it
                continue
            elif status.state in OFFLINE:
                returned.append((status, server))
                continue
            statuses[key] = status
        back = await asyncio.gather(*(self._returned(st, srv, now) for st, srv in returned))
        running = [o == "running" for o in await asyncio.gather(
            *(self._interrupted(st, srv, now) for st, srv in interrupted))]  # fmt: skip
        for (status, _), came_back in zip(returned + interrupted, back + running, strict=True):
            if came_back:  # else: still suspended (the Hub has not seen its end yet), or finishing
                statuses[status.key] = status
        actions = []
        for key, server in zip(keys, servers, strict=True):
            status = statuses.get(key)
            if status is None or key in self._inflight:
                continue
            sample = samples[key]
            touch = self.interactions.get(key, (status.last_sample or {}).get("last_interaction"))
            if touch is not None:
                sample.last_interaction = max(touch, sample.last_interaction or touch)
            # a keep-running or an exemption may have come in through the API meanwhile
            self._merge_keep(status)
            self.samples[key] = sample
            rule = self.policy.rule_for(server)
            new, decision = step(status, sample, rule, now)
            self.decisions[key] = decision
            self._export(key, sample, decision)
            effects = tick_effects(status.state, decision)
            if effects:  # its state change (held with the tick's rows) and its action
                actions.extend(
                    self._execute(new, status.state, effects, server, decision, batch=True)[1]
                )
            self._merge_keep(new, now)
            self.store.put(new)
        if actions:
            await asyncio.gather(*actions)
        self._start_due()

    def _merge_keep(self, status: ServerStatus, now: float | None = None) -> None:
        """Take the stored keep-running time and exemption: the API's requests win over this
        tick's copy."""
        status.exempt = self.store.exempt(status.key, missing=status.exempt)
        keep_until = self.store.keep_until(status.key, missing=status.keep_until)
        if keep_until == status.keep_until:
            return
        if now is not None and keep_until is not None and keep_until <= now:
            return  # expired: the policy just cleared it
        status.keep_until = keep_until

    def _export(self, key: str, sample: Sample, decision: Decision) -> None:
        values = (sample.cpu_percent, sample.gpu_percent, sample.gpu_memory_bytes,
                  sample.kernels_busy, decision.idle_seconds or 0)  # fmt: skip
        last = self._exported.get(key)
        if last == values:
            return  # nothing moved: most servers on most ticks
        self._exported[key] = values
        for i, signal in enumerate(_EXPORTED_SIGNALS):
            value = values[i]
            if value is not None and (last is None or last[i] != value):
                self._gauge(metrics.SIGNAL, key, signal).set(value)
        if last is None or last[4] != values[4]:
            self._gauge(metrics.IDLE_SECONDS, key).set(values[4])

    def _gauge(self, metric, key: str, *labels: str):
        """The metric's child for ``key`` (and ``labels``), looked up once per server, not per tick."""
        children = self._gauges.setdefault(key, {})
        child = children.get((metric, labels))
        if child is None:
            child = children[(metric, labels)] = metric.labels(key, *labels)
        return child

    async def _returned(self, status: ServerStatus, server: Server, now: float) -> bool:
        """A suspended server is running again: it was restored, or started fresh after a failed restore.

        False (nothing changed) when the Hub still lists the very run that was checkpointed:
        it started before its checkpoint was taken, and the Hub has not noticed its end yet
        (its stop call failed, or the service finished the suspension after a crash).
        """
        info, gone = None, False
        if self.backend is not None and status.checkpoint_id:
            try:
                info = await self.backend.get(status.checkpoint_id)
                gone = info is None
            except Exception as e:
                self.log.warning(
                    "%s: could not read checkpoint %s: %s", status.key, status.checkpoint_id, e
                )
        if (
            info is not None
            and server.started is not None
            and server.started.timestamp() < info.created
        ):
            return False
        # a checkpoint that is gone (e.g. its manifest was deleted) was not restored: the
        # spawner started a fresh server
        restored = not gone and (info is None or info.status != "failed")
        kind = "restore" if restored else "restore_failed"
        detail = {"checkpoint": status.checkpoint_id}
        if gone:
            detail["error"] = (
                f"checkpoint {status.checkpoint_id} is gone (no readable manifest); started fresh"
            )
        if info is not None:
            detail.update(
                image_bytes=info.image_bytes,
                gpu_bytes=info.gpu_bytes,
                error=info.error,
                restore_s=info.extra.get("restore_s"),
            )
            if info.extra.get("retention_days") is not None:  # the backend's own word on this one
                detail["retention_days"] = info.extra["retention_days"]
            if restored and info.gpu_count:
                metrics.GPU_SECONDS_FREED.inc(max(0.0, now - status.state_since) * info.gpu_count)
        started = server.started.timestamp() if server.started else now
        ids = self.execute(
            status, "returned", persist=False, now=now, restored=restored, started=started, **detail
        )
        metrics.ACTIONS.labels(action="restore", result="ok" if restored else "failed").inc()
        if not restored:
            metrics.FAILURES.labels(kind="restore").inc()
        self.log.info(
            "%s: %s from checkpoint %s",
            status.key,
            "restored" if restored else "restore failed, fresh start",
            status.checkpoint_id,
        )
        await self._notify(
            "restored" if restored else "restore_failed", status, str(ids[kind]), detail
        )
        return True

    async def _interrupted(self, status: ServerStatus, server: Server | None, now: float) -> str:
        """A suspension a crash of the service interrupted (``suspending``, none under way):
        settle it by the outcome the backend's recovery at start-up decided.

        - The backend holds a verified checkpoint of this suspension (``completed at
          recovery``: the image was complete and the processes ended): the suspension is
          finished as if the service had never stopped (:meth:`_finish_suspension`, in the
          background): stopped in the Hub, recorded ``suspended``, the user emailed once.
        - Otherwise it failed: its processes were resumed (the server is ``active`` again)
          or, with no server running any more, its record is dropped. Logged, counted
          (``gpusnap_failures_total{kind="suspend"}``) and recorded as an event.

        Keep-running and exemption stay as stored. Returns "finishing", "running" (this
        tick applies the policy to it), "failed" (no server left: forget it) or "unknown"
        (the backend could not be read: look again next tick).
        """
        key = status.key
        info = None
        if self.backend is not None:
            try:
                info = await self.backend.latest(status.user, status.name)
            except Exception as e:
                self.log.warning(
                    "%s: cannot read the checkpoint of the interrupted suspension: %s", key, e
                )
                return "unknown"  # look again next tick; nothing is lost meanwhile
        if info is not None and info.created >= status.state_since - 1:
            self.log.warning("%s: suspension interrupted by a service restart; its checkpoint %s is "
                             "verified: finishing it", key, info.id)  # fmt: skip
            task = asyncio.ensure_future(
                self._finish_suspension(status, info, status.reason or "idle", recovered=True)
            )
            self._inflight[key] = task
            task.add_done_callback(lambda _: self._inflight.pop(key, None))
            return "finishing"
        metrics.ACTIONS.labels(action="suspend", result="failed").inc()
        metrics.FAILURES.labels(kind="suspend").inc()
        why = "the service stopped while this server was being checkpointed; the checkpoint failed"
        if server is None:
            self.log.error("%s: suspension interrupted by a service restart; no checkpoint and no server "
                           "running: forgetting it", key)  # fmt: skip
        else:
            self.log.error("%s: suspension interrupted by a service restart; the checkpoint failed and the "
                           "server runs on", key)  # fmt: skip
        self.execute(status, "interrupted", "suspension interrupted by a service restart", persist=False, now=now,
                    error=why, running=server is not None)  # fmt: skip
        return "running" if server is not None else "failed"

    async def _reconcile_gone(self, running: dict[str, Server], now: float) -> None:
        """Forget servers the user stopped; keep suspended ones (their checkpoint is their state)."""
        for key in self.store.keys():  # keys only: reading every row again costs a lot
            if key in running or key in self._inflight:
                continue
            status = self.store.get(key)
            if status is None:
                continue
            if status.state == State.suspending:
                # the service died mid-suspension: the backend's recovery decided the outcome (being
                # finished, unreadable now, or failed with no server left: the policy forgets it)
                await self._interrupted(status, None, now)
                continue
            if status.state not in OFFLINE and not await self._restore_unfinished(status, now):
                self._forget(status.key)

    async def _restore_unfinished(self, status: ServerStatus, now: float) -> bool:
        """A restored server that is gone because its restore could not be finished after it
        ran (a lazy restore: a damaged page, or its GPU memory; the backend stopped it and
        failed its checkpoint): recorded, counted and told as the failed restore it is, not as
        a stop. False for any other server gone."""
        if not (status.restored_at and status.checkpoint_id and self.backend is not None):
            return False
        try:
            info = await self.backend.get(status.checkpoint_id)
        except Exception as e:
            self.log.warning(
                "%s: could not read checkpoint %s: %s", status.key, status.checkpoint_id, e
            )
            return False
        if info is None or info.status != "failed" or not (info.error or "").startswith(UNFINISHED):
            return False
        detail = {"checkpoint": status.checkpoint_id, "error": info.error, "image_bytes": info.image_bytes,
                  "gpu_bytes": info.gpu_bytes}  # fmt: skip
        if info.extra.get("retention_days") is not None:
            detail["retention_days"] = info.extra["retention_days"]
        ids = self.execute(
            status, "restore_unfinished", info.error, persist=False, now=now, **detail
        )
        metrics.ACTIONS.labels(action="restore", result="failed").inc()
        metrics.FAILURES.labels(kind="restore").inc()
        self.log.error(
            "%s: restored from checkpoint %s, then stopped: %s",
            status.key,
            status.checkpoint_id,
            info.error,
        )
        await self._notify("restore_failed", status, str(ids["restore_failed"]), detail)
        return True

    def _forget(self, key: str) -> None:
        """Drop a server's record, metrics and signal state (it is gone, and not suspended)."""
        self.store.delete(key)
        metrics.forget_server(key)
        self._gauges.pop(key, None)
        self._exported.pop(key, None)
        self.samples.pop(key, None)
        self.interactions.forget(key)
        for source in self.sources:
            forget = getattr(source, "forget", None)
            if forget is not None and source.name == "cpu":
                forget(key)

    # ------------------------------------------------------------------ actions
    async def _warn(self, status: ServerStatus, decision: Decision) -> None:
        event = self.store.record_event(status.key, "warn", {"suspend_at": decision.suspend_at})
        metrics.ACTIONS.labels(action="warn", result="ok").inc()
        await self._notify("warning", status, str(event), {"suspend_at": decision.suspend_at,
                                                           "idle_seconds": decision.idle_seconds})  # fmt: skip

    def _start_due(self) -> None:
        """Start this tick's suspensions, the longest idle first: with more due than
        suspend_concurrency, the one idle longest never waits behind newer ones."""
        due, self._due = sorted(self._due, key=lambda d: d[:2]), []
        for _, _, server, plain_stop, reason in due:
            self.start_suspend(server, plain_stop=plain_stop, reason=reason)

    def start_suspend(
        self, server: Server, plain_stop: bool = False, reason: str = "idle"
    ) -> asyncio.Task | None:
        """Suspend a server in the background (bounded by suspend_concurrency)."""
        if server.key in self._inflight:
            return self._inflight[server.key]
        task = asyncio.ensure_future(self._suspend(server, plain_stop, reason))
        self._inflight[server.key] = task
        task.add_done_callback(lambda _: self._inflight.pop(server.key, None))
        return task

    def suspending(self, key: str) -> bool:
        """Whether a suspension of ``key`` is under way (started by this watcher)."""
        return key in self._inflight

    async def wait_idle(self) -> None:
        """Wait for every suspension under way (tests, shutdown)."""
        while self._inflight:
            await asyncio.gather(*list(self._inflight.values()), return_exceptions=True)

    async def _suspend(self, server: Server, plain_stop: bool, reason: str) -> None:
        key = server.key
        async with self._semaphore:
            status = self.store.get(key) or self.new_status(server, self.clock())
            if plain_stop or self.backend is None:
                await self._plain_stop(server, status, reason)
                return
            self.execute(status, "suspend_started", reason)
            t0 = time.perf_counter()
            try:
                # checkpoint() runs the preflight itself (refusing as check() would)
                info = await asyncio.wait_for(self.backend.checkpoint(server), self.suspend_timeout)
            except CheckpointRefused as e:
                result = "refused"
                if e.retry:  # a busy GPU: the server is working; try again on a later tick
                    self.execute(status, "suspend_refused", str(e))
                else:
                    self.execute(status, "suspend_failed", str(e))
                metrics.ACTIONS.labels(action="suspend", result=result).inc()
                self.log.warning("%s: suspension refused: %s", key, e)
                return
            except (CheckpointError, asyncio.TimeoutError, Exception) as e:
                why = str(e) or type(e).__name__
                self.log.error("%s: suspension failed, server left running: %s", key, why)
                metrics.ACTIONS.labels(action="suspend", result="failed").inc()
                metrics.FAILURES.labels(kind="suspend").inc()
                self.execute(status, "suspend_failed", why)
                return
            metrics.ACTION_SECONDS.labels(action="suspend").observe(time.perf_counter() - t0)
            await self._finish_suspension(status, info, reason)

    async def _finish_suspension(
        self, status: ServerStatus, info, reason: str, recovered: bool = False
    ) -> None:
        """The checkpoint is verified and the processes are gone: stop the server in the Hub,
        claim the user's "suspended" email, then record the server ``suspended``.

        The email is claimed (in the store, by checkpoint id) before the state is recorded:
        a crash between the two leaves the row ``suspending``, the next start finishes the
        suspension again (``recovered``) and finds the email claimed, so the user never gets
        two; a crash after the claim and before the SMTP server took it loses that one email.
        """
        key = status.key
        try:
            if not recovered or await self._hub_runs(status):
                await self.hub.stop_server(status.user, status.name)
        except (HubError, OSError) as e:
            # The spawner's poll finds the process gone and stops it with will_resume; not lost.
            metrics.FAILURES.labels(kind="hub").inc()
            self.log.warning(
                "%s: checkpoint verified but the Hub stop failed (%s); the Hub's poll will stop it",
                key,
                e,
            )
        detail = info.as_dict()
        if recovered:
            detail["recovered"] = True
        await self._notify("suspended", status, info.id, detail, wait_claim=True)
        self.execute(status, "suspended", reason, checkpoint=info.id, record=detail)
        metrics.ACTIONS.labels(action="suspend", result="ok").inc()
        self.log.info("%s: suspended to checkpoint %s (%d bytes)%s", key, info.id, info.image_bytes,
                      " at recovery" if recovered else "")  # fmt: skip

    async def _hub_runs(self, status: ServerStatus) -> bool:
        """Whether the Hub still lists the server as running or starting."""
        model = await self.hub.get_user(status.user)
        s = (model.get("servers") or {}).get(status.name)
        return bool(s and (s.get("ready") or s.get("pending")))

    async def _plain_stop(self, server: Server, status: ServerStatus, reason: str) -> None:
        try:
            await self.hub.stop_server(server.user, server.name)
        except HubError as e:
            metrics.ACTIONS.labels(action="stop", result="failed").inc()
            self.execute(status, "stop_failed", str(e))
            return
        self.execute(status, "stopped", reason, persist=False)
        metrics.ACTIONS.labels(action="stop", result="ok").inc()
        self.log.info("%s: stopped (no checkpoint: rule action 'stop'): %s", server.key, reason)

    def execute(self, status: ServerStatus, kind: str, reason: str = "", persist: bool = True,
                now: float | None = None, **detail) -> dict[str, int]:  # fmt: skip
        """The one executor of the policy's :func:`~.policy.transition` outside a tick's sample.

        Runs event ``kind`` through it, updates ``status`` (the caller's object) to the result,
        carries out the effects in order and, with ``persist``, writes the row at once
        (suspending/suspended/failed must survive a crash). Returns the ids of the events
        recorded, by kind.
        """
        now = self.clock() if now is None else now
        new, effects = transition(status, Event(kind, now, reason, detail))
        was = status.state
        status.__dict__.update(new.__dict__)
        ids, pending = self._execute(status, was, effects)
        for coro in pending:  # an exemption's unpark: in the background, as a tick's would be
            task = asyncio.ensure_future(coro)
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        if persist:
            self.store.put(status, now=True)
        return ids

    def _execute(self, status: ServerStatus, was: State, effects: list[Effect], server: Server | None = None,
                 decision: Decision | None = None, batch: bool = False) -> tuple[dict[str, int], list[Coroutine]]:  # fmt: skip
        """The one executor: carry out the policy's effects for ``status`` (whose state was
        ``was``), in order. Returns the ids of the events recorded, by kind, and what is left
        to await (a warning's email, a park or unpark); suspensions start once the tick has
        seen every server, the longest idle first (:meth:`_start_due`). With ``batch`` (a
        tick's effects) an event is held and written with the tick's rows, one write per
        tick, and has no id."""
        ids: dict[str, int] = {}
        pending: list[Coroutine] = []
        for effect in effects:
            action = effect.action
            if action == "record":
                if effect.kind == "state":
                    self.log.info(
                        "%s: %s -> %s (%s)", status.key, was, status.state, effect.detail["reason"]
                    )
                if batch:
                    self.store.add_event(status.key, effect.kind, effect.detail)
                else:
                    ids[effect.kind] = self.store.record_event(
                        status.key, effect.kind, effect.detail
                    )
            elif action == "forget":
                self._forget(status.key)
            elif action == "warn":
                pending.append(self._warn(status, decision))
            elif action in ("suspend", "stop"):
                self._due.append(
                    (-decision.idle_seconds, server.key, server, action == "stop", decision.reason)
                )
            elif action in ("park", "unpark"):
                server = server or self.servers.get(status.key)
                if server is not None:
                    pending.append(self.room.park(server, status, unpark=(action == "unpark")))
        return ids, pending

    async def _notify(self, kind: str, status: ServerStatus, event_ref: str, detail: dict,
                      wait_claim: bool = False) -> None:  # fmt: skip
        """Send ``kind`` email in the background; with ``wait_claim``, return once it is
        claimed in the store (or known not to be sent), at most CLAIM_TIMEOUT s later."""
        if self.notifier is None:
            return
        claimed = asyncio.get_running_loop().create_future() if wait_claim else None
        try:
            task = await self.notifier.notify_event(
                kind, status, event_ref, detail, claimed=claimed
            )
            if claimed is not None:
                await asyncio.wait(
                    {claimed, task}, timeout=CLAIM_TIMEOUT, return_when=asyncio.FIRST_COMPLETED
                )
        except Exception as e:  # email never blocks or undoes a checkpoint
            metrics.FAILURES.labels(kind="email").inc()
            self.log.error("%s: %s email failed: %s", status.key, kind, e)

    # ------------------------------------------------------------ user requests
    def record_interaction(self, key: str) -> float:
        """The user used JupyterLab on ``key`` just now (the Lab extension said so); the
        next tick puts it into the server's sample. Returns the time recorded."""
        if key not in self.servers or self.store.get(key) is None:
            raise KeyError(key)
        return self.interactions.record(key, self.clock())

    def clear_keep(self, status: ServerStatus, why: str) -> None:
        """Drop a keep-running request (a manual "suspend now" ends it)."""
        if status.keep_until is None:
            return
        self.execute(status, "keep_ended", why)
        self.log.info("%s: keep-running ended (%s)", status.key, why)

    def request_keep(self, key: str, until: float) -> ServerStatus:
        if not math.isfinite(until):  # checked before anything changes
            raise ValueError("the keep-running end must be a finite time")
        status = self.store.get(key)
        if status is None:
            raise KeyError(key)
        server = self.servers.get(key)
        rule = self.policy.rule_for(server) if server else self.policy.default
        until = clamp_keep(until, self.clock(), rule)
        self.execute(status, "keep", "keep running requested", until=until)
        self.log.info(
            "%s: kept running until %s",
            key,
            time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(status.keep_until)),
        )
        return status

    def request_exempt(self, key: str, exempt: bool, by: str) -> ServerStatus:
        """An admin exempts ``key`` from suspension (``exempt``) or lifts its exemption."""
        status = self.store.get(key)
        if status is None:
            raise KeyError(key)
        kind, words = ("exempt", "exempted") if exempt else ("exempt_lifted", "exemption lifted")
        self.execute(status, kind, f"{words} by {by}")
        return status
