"""The service's database: per-server status, an event log, and sent notifications.

Any SQLAlchemy URL works (``sqlite:///path/gpusnap.sqlite`` by default,
``postgresql://…`` for a shared deployment). Each method is one short
transaction, so the synchronous calls do not hold up the event loop. A SQLite
file is created readable by its owner only: it names users and their servers.
"""

from __future__ import annotations

import os
import time
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

    def get(self, key: str) -> ServerStatus | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(servers).where(servers.c.key == key)).first()
        return self._to_status(row) if row else None

    def put(self, status: ServerStatus) -> None:
        """Insert or replace the row of ``status.key``."""
        values = {f: getattr(status, f) for f in _FIELDS}
        values["state"] = State(status.state).value
        values["last_sample"] = dict(status.last_sample or {})
        with self.engine.begin() as conn:
            done = conn.execute(update(servers).where(servers.c.key == status.key), values)
            if done.rowcount == 0:
                conn.execute(insert(servers), values)

    def all(self) -> list[ServerStatus]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(servers).order_by(servers.c.key)).all()
        return [self._to_status(r) for r in rows]

    def delete(self, key: str) -> None:
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
