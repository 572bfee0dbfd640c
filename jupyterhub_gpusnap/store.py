"""The service's database: per-server status, an event log, and sent notifications.

Any SQLAlchemy URL works (``sqlite:///path/gpusnap.sqlite`` by default,
``postgresql://…`` for a shared deployment). Each method is one short
transaction, so the synchronous calls do not hold up the event loop. A SQLite
file is created readable by its owner only: it names users and their servers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import (
    JSON,
    Column,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    bindparam,
    create_engine,
    delete,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.pool import StaticPool

from .model import State
from .policy import ServerStatus

metadata = MetaData()

servers = Table(
    "servers",
    metadata,
    Column("key", String(255), primary_key=True),
    Column("user", String(255), nullable=False),
    Column("name", String(255), nullable=False, default=""),
    Column("state", String(32), nullable=False),
    Column("state_since", Float, nullable=False),
    Column("last_active", Float, nullable=False),
    Column("started", Float, nullable=False),
    Column("keep_until", Float),
    Column("restored_at", Float),
    Column("rule", String(255), nullable=False, default=""),
    Column("reason", Text, nullable=False, default=""),
    Column("checkpoint_id", String(1024), nullable=False, default=""),
    Column("failure", Text, nullable=False, default=""),
    Column("failures", Integer, nullable=False, default=0),
    Column("last_sample", JSON, nullable=False, default=dict),
    Column("warned_at", Float),
)

events = Table(
    "events",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("time", Float, nullable=False),
    Column("key", String(255), nullable=False),
    Column("kind", String(64), nullable=False),
    Column("detail", JSON, nullable=False, default=dict),
    Index("ix_events_key_id", "key", "id"),
)

notifications = Table(
    "notifications",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("time", Float, nullable=False),
    Column("key", String(255), nullable=False),
    Column("kind", String(64), nullable=False),
    Column("event_ref", String(255), nullable=False),
    UniqueConstraint("key", "kind", "event_ref", name="uq_notification"),
)

_FIELDS = [c.name for c in servers.columns]


def _sqlite_file(url: str) -> Path | None:
    """The database file of a SQLite URL, or None (in-memory, or not SQLite)."""
    u = make_url(url)
    if u.get_backend_name() != "sqlite" or u.database in (None, "", ":memory:"):
        return None
    if u.database.startswith("file:"):
        return None
    return Path(u.database)


def _create_private(path: Path) -> None:
    """Create ``path`` with mode 0600 before SQLite opens it (SQLite would use the umask)."""
    if not path.parent.is_dir():
        raise ValueError(
            f"cannot create the database {path}: folder {path.parent} does not exist; "
            "create it or point the database URL elsewhere"
        )
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)
    os.close(fd)
    os.chmod(path, 0o600)


class Store:
    """Per-server :class:`ServerStatus`, the event log and sent notifications, in one database."""

    def __init__(self, url: str = "sqlite:///gpusnap.sqlite"):
        self.url = url
        path = _sqlite_file(url)
        if path is not None and not path.exists():
            _create_private(path)
        kwargs: dict = {}
        if make_url(url).get_backend_name() == "sqlite":
            kwargs["connect_args"] = {"check_same_thread": False}
            if path is None:  # in-memory: one shared connection, or every call sees a new db
                kwargs["poolclass"] = StaticPool
        self.engine: Engine = create_engine(url, **kwargs)
        metadata.create_all(self.engine)
        self._pending: dict[str, dict] | None = None  # put() rows held by batch()
        self._cache: dict[str, dict] | None = None  # rows read once by batch(preload=True)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # servers

    @staticmethod
    def _to_status(row) -> ServerStatus:
        d = dict(row._mapping)
        d["state"] = State(d["state"])
        d["last_sample"] = d["last_sample"] or {}
        return ServerStatus(**d)

    @staticmethod
    def _values(status: ServerStatus) -> dict:
        values = {f: getattr(status, f) for f in _FIELDS}
        values["state"] = State(status.state).value
        values["last_sample"] = dict(status.last_sample or {})
        return values

    @staticmethod
    def _from_values(values: dict) -> ServerStatus:
        d = dict(values)
        d["state"] = State(d["state"])
        d["last_sample"] = dict(d["last_sample"] or {})
        return ServerStatus(**d)

    def get(self, key: str) -> ServerStatus | None:
        if self._pending is not None and key in self._pending:
            return self._from_values(self._pending[key])
        if self._cache is not None:
            values = self._cache.get(key)
            return self._from_values(values) if values else None
        with self.engine.connect() as conn:
            row = conn.execute(select(servers).where(servers.c.key == key)).first()
        return self._to_status(row) if row else None

    def put(self, status: ServerStatus, now: bool = False) -> None:
        """Insert or replace the row of ``status.key``.

        Inside :meth:`batch` the write is held until the batch ends, unless ``now`` is
        true (a state the service must find after a crash, e.g. ``suspending``).
        """
        values = self._values(status)
        if self._pending is not None and not now:
            self._pending[status.key] = values
            return
        if self._pending is not None:
            self._pending.pop(status.key, None)
        if self._cache is not None:
            self._cache[status.key] = values
        self.put_many([status])

    def put_many(self, statuses: Iterable[ServerStatus]) -> None:
        """Insert or replace many rows in one transaction (one commit, not one per server)."""
        self._write_rows([self._values(s) for s in statuses])

    def _write_rows(self, rows: list[dict]) -> None:
        if not rows:
            return
        with self.engine.begin() as conn:
            keys = [r["key"] for r in rows]
            existing: set[str] = set()
            for i in range(0, len(keys), 500):  # stay under SQLite's bound-parameter limit
                chunk = keys[i : i + 500]
                q = select(servers.c.key).where(servers.c.key.in_(chunk))
                existing.update(conn.execute(q).scalars())
            old = [{**r, "b_key": r["key"]} for r in rows if r["key"] in existing]
            new = [r for r in rows if r["key"] not in existing]
            if old:
                conn.execute(update(servers).where(servers.c.key == bindparam("b_key")), old)
            if new:
                conn.execute(insert(servers), new)

    @contextmanager
    def batch(self, preload: bool = False) -> Iterator[Store]:
        """Hold :meth:`put` writes in memory and write them in one transaction at the end.

        A tick over thousands of servers would otherwise commit once per server (one
        disk sync each on SQLite). Inside a batch, :meth:`get` and :meth:`all` see the
        held writes; :meth:`delete`, ``put(..., now=True)``, events and notifications
        are written at once. With ``preload`` every row is read once up front and
        :meth:`get` answers from memory (the service is the database's only writer).
        The held writes are written even when the block raises. Nested batches join
        the outer one.
        """
        if self._pending is not None:
            yield self
            return
        self._pending = {}
        if preload:
            with self.engine.connect() as conn:
                self._cache = {r.key: self._row_values(r) for r in conn.execute(select(servers))}
        try:
            yield self
        finally:
            pending, self._pending, self._cache = self._pending, None, None
            self._write_rows(list(pending.values()))

    @staticmethod
    def _row_values(row) -> dict:
        d = dict(row._mapping)
        d["last_sample"] = d["last_sample"] or {}
        return d

    def all(self) -> list[ServerStatus]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(servers).order_by(servers.c.key)).all()
        out = [self._to_status(r) for r in rows]
        if self._pending:
            merged = {s.key: s for s in out}
            merged.update({k: self._from_values(v) for k, v in self._pending.items()})
            out = [merged[k] for k in sorted(merged)]
        return out

    def keys(self) -> list[str]:
        """Every server's key, sorted (held batch writes included); cheaper than :meth:`all`."""
        with self.engine.connect() as conn:
            keys = set(conn.execute(select(servers.c.key)).scalars())
        if self._pending:
            keys.update(self._pending)
        return sorted(keys)

    def delete(self, key: str) -> None:
        if self._pending is not None:
            self._pending.pop(key, None)
        if self._cache is not None:
            self._cache.pop(key, None)
        with self.engine.begin() as conn:
            conn.execute(delete(servers).where(servers.c.key == key))

    def counts_by_state(self) -> dict[str, int]:
        """Number of servers in each state; every state is present (0 if none), for metrics."""
        counts = {s.value: 0 for s in State}
        with self.engine.connect() as conn:
            q = select(servers.c.state, func.count()).group_by(servers.c.state)
            for state, n in conn.execute(q):
                counts[state] = n
        return counts

    # events

    def record_event(self, key: str, kind: str, detail: dict, now: float | None = None) -> int:
        """Append an event (``state``, ``suspend``, ``suspend_failed``, ``restore``, ``warn``…).

        Returns its id, which increases with every event (a stable ``event_ref``).
        """
        row = {"time": time.time() if now is None else now, "key": key, "kind": kind}
        with self.engine.begin() as conn:
            result = conn.execute(insert(events), {**row, "detail": dict(detail or {})})
            return int(result.inserted_primary_key[0])

    def events(self, key: str | None = None, limit: int = 50) -> list[dict]:
        """The newest ``limit`` events (of one server if ``key`` is given), newest first."""
        q = select(events).order_by(events.c.id.desc()).limit(limit)
        if key is not None:
            q = q.where(events.c.key == key)
        with self.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(q)]

    # notifications

    def notification_sent(self, key: str, kind: str, event_ref: str | int) -> bool:
        q = select(notifications.c.id).where(
            notifications.c.key == key,
            notifications.c.kind == kind,
            notifications.c.event_ref == str(event_ref),
        )
        with self.engine.connect() as conn:
            return conn.execute(q).first() is not None

    def record_notification(self, key: str, kind: str, event_ref: str | int) -> bool:
        """Claim the right to send one notification; False if someone already did.

        Record *before* sending: the unique (key, kind, event_ref) constraint makes
        sure two racing senders never both send.
        """
        row = {"time": time.time(), "key": key, "kind": kind, "event_ref": str(event_ref)}
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(notifications), row)
        except IntegrityError:
            return False
        return True

    def release_notification(self, key: str, kind: str, event_ref: str | int) -> None:
        """Undo :meth:`record_notification` when sending failed, so a later try may send."""
        with self.engine.begin() as conn:
            conn.execute(
                delete(notifications).where(
                    notifications.c.key == key,
                    notifications.c.kind == kind,
                    notifications.c.event_ref == str(event_ref),
                )
            )
