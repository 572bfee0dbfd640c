"""Scrub the chunk store: re-read every chunk, keep second copies of shared ones, repair.

A chunk is stored once however many snapshots use it (:mod:`.chunks`), so one damaged
chunk (a flipped bit, a bad sector) breaks every snapshot that lists it. Protection grows
with that number:

- **every chunk** is checked against its id whenever it is read: at restore (nothing runs
  from a damaged image), and when a later checkpoint finds it stored already and reads it
  back before trusting it (``LocalBackend.verify_dedup``; a damaged copy is replaced by the
  fresh data, a repair);
- **a chunk that the snapshots of ``LocalBackend.replicate_min_servers`` servers or more
  need** is stored twice: a replica (the same bytes, sealed the same way) under
  ``LocalBackend.replica_dir``. A read that meets a damaged chunk uses the replica and
  puts the chunk back from it;
- **the scrub** (:func:`scrub`) re-reads every chunk that checkpoints list, and its replica,
  at a bounded rate (``LocalBackend.scrub_bytes_per_second``) every
  ``LocalBackend.scrub_interval``, mends either copy from the other, and marks what cannot
  be mended: the snapshots that need a lost chunk become ``failed`` with an error that says
  so (their servers start fresh on their next start, instead of failing to restore then).
  Between full passes, each call makes the replicas that newly shared chunks lack.

Found damage is logged, counted (``gpusnap_chunks_damaged_total{found_by, result}``) and
shown: the checkpoint's ``error`` and ``extra["damaged_chunks"]``, and
``gpusnap_checkpoints_damaged``. docs/operations.md, "Scrub and repair", has the story for
admins and the measured costs.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from prometheus_client import Counter, Gauge

from ..metrics import REGISTRY
from ..model import server_key
from .chunks import ChunkStore
from .manifest import MANIFEST, Manifest

STATE = ".scrub.json"  # in the chunk store: when the last full pass ended, and its outcome

CHUNKS_DAMAGED = Counter(
    "gpusnap_chunks_damaged",
    "Chunks of the local chunk store found damaged or missing, by found_by (write: a "
    "checkpoint found its stored copy damaged; read: a restore or check; scrub) and result "
    "(repaired: from the fresh data or the other copy; unrepairable: no intact copy).",
    ["found_by", "result"],
    registry=REGISTRY,
)
SCRUB_BYTES = Counter(
    "gpusnap_scrub_bytes", "Bytes of chunks and replicas read back by scrubs.", registry=REGISTRY
)
CHECKPOINTS_DAMAGED = Gauge(
    "gpusnap_checkpoints_damaged",
    "Checkpoints that list a chunk found damaged beyond repair (as of the last scrub); each "
    "names it in its error and extra.damaged_chunks.",
    registry=REGISTRY,
)
SCRUB_COMPLETED = Gauge(
    "gpusnap_scrub_completed_timestamp_seconds",
    "When the last full scrub of the chunk store ended (Unix time; 0: none yet).",
    registry=REGISTRY,
)


def count_damage(found_by: str, repaired: bool) -> None:
    CHUNKS_DAMAGED.labels(
        found_by=found_by, result="repaired" if repaired else "unrepairable"
    ).inc()


@dataclass
class Need:
    """One chunk as the checkpoints list it: its length, the checkpoints (id, file) that
    list it and the servers whose snapshots still need it."""

    length: int
    users: list[tuple[str, str]] = field(default_factory=list)
    servers: set[str] = field(default_factory=set)


@dataclass
class ScrubReport:
    full: bool = False
    chunks: int = 0  # chunks looked at
    bytes_read: int = 0
    seconds: float = 0.0
    ok: int = 0
    replicated: int = 0
    repaired: list[str] = field(default_factory=list)  # "<id prefix>: what was wrong"
    damaged: list[str] = field(default_factory=list)
    unchecked: int = 0  # sealed with a key not in the key file
    checkpoints_damaged: list[str] = field(default_factory=list)  # ids marked by this pass

    def as_dict(self) -> dict:
        return asdict(self)


def needed(m: Manifest, rescuable: bool) -> bool:
    """True when a snapshot may still be restored (or rescued): its chunks matter."""
    return m.status == "verified" or rescuable


def plan(found: Iterable[tuple[str, Manifest, bool]]) -> dict[tuple[str, str], Need]:
    """{(space, chunk id): Need} over ``(checkpoint id, manifest, rescuable)`` entries."""
    out: dict[tuple[str, str], Need] = {}
    for cid, m, rescuable in found:
        if m.storage != "chunks" or m.status == "writing":
            continue
        who = server_key(m.user, m.server)
        for name, refs in m.chunks.items():
            for chunk, length in refs:
                need = out.get((m.key_id, chunk))
                if need is None:
                    need = out[(m.key_id, chunk)] = Need(length)
                if not need.users or need.users[-1][0] != cid:
                    need.users.append((cid, name))
                if needed(m, rescuable):
                    need.servers.add(who)
    return out


def load_state(store: ChunkStore) -> dict:
    try:
        return json.loads((store.root / STATE).read_text())
    except (OSError, ValueError):
        return {}


def save_state(store: ChunkStore, state: dict) -> None:
    tmp = store.root / f".{STATE}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, json.dumps(state, indent=1, sort_keys=True).encode())
    finally:
        os.close(fd)
    os.replace(tmp, store.root / STATE)


async def scrub(
    store: ChunkStore,
    found: list[tuple[str, Path, Manifest, bool]],
    *,
    full: bool,
    min_servers: int,
    bytes_per_second: int,
    log,
    parallel: int = 4,
) -> ScrubReport:
    """One scrub over the checkpoints ``found`` (``(id, folder, manifest, rescuable)``).

    ``full``: re-read every chunk they list (and its replica); else only make the replicas
    that chunks needed by ``min_servers`` servers or more lack (reading those chunks, which
    checks them too). At most ``bytes_per_second`` are read (0: no limit), ``parallel``
    chunks at a time in the store's pool. Unrepairable chunks mark the checkpoints that
    list them (see :func:`mark_damaged`).
    """
    t0 = time.monotonic()
    report = ScrubReport(full=full)
    needs = plan((cid, m, rescuable) for cid, _, m, rescuable in found)

    def want_replica(need: Need) -> bool:
        return min_servers > 0 and len(need.servers) >= min_servers

    todo = []
    for (space, chunk), need in sorted(needs.items()):
        want = want_replica(need) and store.replica_root is not None
        if full or (want and not store.replica_path(space, chunk).exists()):
            todo.append((space, chunk, need, want))
    loop = asyncio.get_running_loop()
    folders = {cid: folder for cid, folder, _, _ in found}
    lost: dict[tuple[str, str], str] = {}
    for start in range(0, len(todo), max(1, parallel)):
        batch = todo[start : start + max(1, parallel)]
        results = await asyncio.gather(*(
            loop.run_in_executor(store.pool, store.scrub_chunk, space, chunk, need.length, want)
            for space, chunk, need, want in batch
        ))  # fmt: skip
        for (space, chunk, need, _), (outcome, nread, what) in zip(batch, results, strict=True):
            report.chunks += 1
            report.bytes_read += nread
            SCRUB_BYTES.inc(nread)
            if outcome == "ok":
                report.ok += 1
            elif outcome == "replicated":
                report.replicated += 1
            elif outcome == "unchecked":
                report.unchecked += 1
            elif outcome == "repaired":
                report.repaired.append(f"{chunk[:12]}…: {what}")
                count_damage("scrub", True)
                log.warning("chunk scrub: chunk %s… repaired from its other copy (%s); "
                            "needed by %s", chunk[:12], what, _names(need))  # fmt: skip
            elif any((folders[cid] / MANIFEST).is_file() for cid, _ in need.users):
                lost[(space, chunk)] = what
                report.damaged.append(f"{chunk[:12]}…: {what}")
                count_damage("scrub", False)
            # else: every checkpoint that listed it was deleted meanwhile (and a sweep took it)
        if bytes_per_second > 0:  # stay within the I/O budget
            ahead = report.bytes_read / bytes_per_second - (time.monotonic() - t0)
            if ahead > 0:
                await asyncio.sleep(ahead)
    if report.unchecked:
        log.warning("chunk scrub: %d chunks not checked: sealed with a key that is not in "
                    "LocalBackend.encryption_key_file", report.unchecked)  # fmt: skip
    if lost:
        report.checkpoints_damaged = await asyncio.to_thread(mark_damaged, lost, needs, found, log)
    report.seconds = round(time.monotonic() - t0, 3)
    damaged_now = 0
    for _, folder, _, _ in found:
        try:
            damaged_now += bool(Manifest.load(folder).extra.get("damaged_chunks"))
        except (OSError, ValueError, TypeError):
            continue
    CHECKPOINTS_DAMAGED.set(damaged_now)
    if full:
        now = time.time()
        save_state(store, {"last_full_end": now, "report": report.as_dict()})
        SCRUB_COMPLETED.set(now)
    if full or report.replicated or report.repaired or report.damaged:
        log.info(
            "chunk scrub%s: %d chunks, %.1f MiB read in %.1fs; %d replicas made, %d repaired, "
            "%d damaged beyond repair (%d checkpoints marked failed)",
            " (full)" if full else "", report.chunks, report.bytes_read / 2**20, report.seconds,
            report.replicated, len(report.repaired), len(report.damaged),
            len(report.checkpoints_damaged),
        )  # fmt: skip
    return report


def _names(need: Need) -> str:
    return ", ".join(sorted({cid for cid, _ in need.users})) or "no checkpoint"


def mark_damaged(
    lost: dict[tuple[str, str], str],
    needs: dict[tuple[str, str], Need],
    found: list[tuple[str, Path, Manifest, bool]],
    log,
) -> list[str]:
    """Record lost chunks in the checkpoints that list them; the ids of those newly made
    ``failed`` (a ``verified`` snapshot that cannot be restored any more).

    Each manifest is read again first: one deleted or changed since the scrub began is
    judged as it is now. A failed snapshot keeps its status and gains the note.
    """
    folders = {cid: folder for cid, folder, _, _ in found}
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    per_checkpoint: dict[str, list[tuple[str, str, str]]] = {}
    for (space, chunk), what in lost.items():
        for cid, name in needs[(space, chunk)].users:
            per_checkpoint.setdefault(cid, []).append((chunk, name, what))
    marked = []
    for cid, chunks in sorted(per_checkpoint.items()):
        folder = folders[cid]
        try:
            m = Manifest.load(folder)
        except (OSError, ValueError, TypeError):
            continue  # deleted meanwhile
        listed = {c for refs in m.chunks.values() for c, _ in refs}
        chunks = [c for c in chunks if c[0] in listed]
        if not chunks:
            continue
        notes = m.extra.setdefault("damaged_chunks", [])
        for chunk, name, _ in chunks:
            if not any(n.get("chunk") == chunk for n in notes):
                notes.append({"chunk": chunk, "file": name, "found": when})
        chunk, name, what = chunks[0]
        more = f" (and {len(chunks) - 1} more)" if len(chunks) > 1 else ""
        if m.status == "verified":
            m.status = "failed"
            m.error = (
                f"damaged beyond repair, found by the chunk scrub on {when}: {what}, in {name}{more}. "
                "This snapshot cannot be restored; the server starts fresh on its next start. "
                "If a backup holds the chunk file, put it back and mark the checkpoint verified "
                "again (docs/operations.md, 'Scrub and repair')"
            )
            m.extra["failed_at"] = time.time()
            m.extra["failed_by"] = "scrub"
            marked.append(cid)
        m.save(folder)
        log.error(
            "%s: checkpoint %s lists chunk %s… (%s), damaged beyond repair: %s%s; %s",
            server_key(m.user, m.server), cid, chunk[:12], name, what, more,
            "marked failed" if cid in marked else f"it stays {m.status}",
        )  # fmt: skip
    return marked
