"""The service's database: per-server status, an event log, and sent notifications.

Any SQLAlchemy URL works (``sqlite:///path/gpusnap.sqlite`` by default,
``postgresql://…`` for a shared deployment). Each method is one short
transaction, so the synchronous calls do not hold up the event loop. A SQLite
file is created readable by its owner only: it names users and their servers.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import (
    JSON,
    Boolean,
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
    inspect,
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
    Column("exempt", Boolean, nullable=False, default=False),
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
_COLUMNS = tuple(f for f in _FIELDS if f != "key")  # what an update may change
_STATES = {s.value: s for s in State}  # State(value) without the enum call, for every row
# Older versions: "restoring" was declared but never entered, and an admin's exemption was a
# keep-running until 2100-01-01 (this keep_until); both read as what they stood for.
_STATES["restoring"] = State.suspended
OLD_EXEMPT_UNTIL = 4102444800.0


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
        self._upgrade()
        self._pending: dict[str, dict] | None = None  # put() rows held by batch()
        self._cache: dict[str, dict] | None = None  # rows read once by batch(preload=True)
        # Every stored row as this store last read or wrote it, kept from one preloading batch
        # to the next (the service is the database's only writer); None: read them again.
        self._rows: dict[str, dict] | None = None
        self._held_events: list[dict] = []  # add_event() rows held by batch()

    def _upgrade(self) -> None:
        """Bring a database written by an older version up to date: the ``exempt`` column,
        and an exemption stored as a keep-running until 2100 turned into that flag."""
        columns = {c["name"] for c in inspect(self.engine).get_columns("servers")}
        with self.engine.begin() as conn:
            if "exempt" not in columns:
                conn.exec_driver_sql(
                    "ALTER TABLE servers ADD COLUMN exempt BOOLEAN NOT NULL DEFAULT FALSE"
                )
            old = servers.c.keep_until == OLD_EXEMPT_UNTIL
            conn.execute(update(servers).where(old).values(exempt=True, keep_until=None))

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
        d["state"] = _STATES.get(d["state"]) or State(d["state"])
        d["last_sample"] = d["last_sample"] or {}
        return ServerStatus(**d)

    @staticmethod
    def _values(status: ServerStatus) -> dict:
        fields = status.__dict__  # a dataclass: its fields are its attributes
        values = {f: fields[f] for f in _FIELDS}
        state = _STATES.get(status.state)  # a State or its value
        values["state"] = state.value if state is not None else State(status.state).value
        values["last_sample"] = dict(status.last_sample or {})
        return values

    @staticmethod
    def _from_values(values: dict) -> ServerStatus:
        status = object.__new__(ServerStatus)  # ServerStatus(**values) without the call's cost
        d = status.__dict__
        d.update(values)
        d["state"] = _STATES.get(d["state"]) or State(d["state"])
        d["last_sample"] = dict(d["last_sample"] or {})
        return status

    def get(self, key: str) -> ServerStatus | None:
        if self._pending is not None and key in self._pending:
            return self._from_values(self._pending[key])
        if self._cache is not None:
            values = self._cache.get(key)
            return self._from_values(values) if values else None
        with self.engine.connect() as conn:
            row = conn.execute(select(servers).where(servers.c.key == key)).first()
        return self._to_status(row) if row else None

    def keep_until(self, key: str, missing: float | None = None) -> float | None:
        """The stored keep-running time of ``key`` (None: not kept); ``missing`` if no such server.

        The one field the watcher re-reads after every signal reading: cheaper than
        :meth:`get`, which builds a whole :class:`ServerStatus`.
        """
        if self._pending is not None and key in self._pending:
            return self._pending[key]["keep_until"]
        if self._cache is not None:
            values = self._cache.get(key)
            return values["keep_until"] if values is not None else missing
        with self.engine.connect() as conn:
            row = conn.execute(select(servers.c.keep_until).where(servers.c.key == key)).first()
        return row[0] if row is not None else missing

    def exempt(self, key: str, missing: bool = False) -> bool:
        """Whether an admin exempted ``key`` (as stored); ``missing`` if no such server.

        Re-read by the watcher after every signal reading, as :meth:`keep_until` is.
        """
        if self._pending is not None and key in self._pending:
            return bool(self._pending[key]["exempt"])
        if self._cache is not None:
            values = self._cache.get(key)
            return bool(values["exempt"]) if values is not None else missing
        with self.engine.connect() as conn:
            row = conn.execute(select(servers.c.exempt).where(servers.c.key == key)).first()
        return bool(row[0]) if row is not None else missing

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
        self._write_rows([values])

    def put_many(self, statuses: Iterable[ServerStatus]) -> None:
        """Insert or replace many rows in one transaction (one commit, not one per server)."""
        self._write_rows([self._values(s) for s in statuses])

    def _write_rows(
        self, rows: list[dict], events_too: bool = False, stored: dict[str, dict] | None = None
    ) -> None:
        """Insert or update ``rows`` (and write held events) in one transaction.

        With ``stored`` (every stored row, by key, as :meth:`batch` preloaded it) a row
        already stored is updated in the columns that changed only, and one that did not
        change is not written: a tick mostly moves ``last_sample`` and little else.
        """
        held = self._take_events() if events_too else []
        if not rows and not held:
            return
        try:
            with self.engine.begin() as conn:
                if held:
                    conn.execute(insert(events), held)
                if stored is not None:
                    self._write_changes(conn, rows, stored)
                else:
                    self._write_all(conn, rows)
        except BaseException:
            self._rows = self._cache = None  # what was written is unknown: read again
            raise
        if self._rows is not None:
            self._rows.update((r["key"], r) for r in rows)
        if self._cache is not None and self._cache is not self._rows:
            self._cache.update((r["key"], r) for r in rows)

    @staticmethod
    def _write_all(conn, rows: list[dict]) -> None:
        """Insert or update whole rows, looking up which exist."""
        if rows:
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

    @staticmethod
    def _write_changes(conn, rows: list[dict], stored: dict[str, dict]) -> None:
        by_columns: dict[tuple[str, ...], list[dict]] = {}
        new = []
        for row in rows:
            old = stored.get(row["key"])
            if old is None:
                new.append(row)
                continue
            changed = tuple([c for c in _COLUMNS if row[c] != old[c]])
            if changed:
                by_columns.setdefault(changed, []).append(row)
        for columns, changed_rows in by_columns.items():  # one executemany per set of columns
            Store._update_many(conn, columns, changed_rows)
        if new:
            conn.execute(insert(servers), new)

    @staticmethod
    def _update_many(conn, columns: tuple[str, ...], rows: list[dict]) -> None:
        """Update ``columns`` of ``rows`` (by key) in one executemany."""
        if conn.dialect.name == "sqlite":
            # SQLite's own driver directly: SQLAlchemy's per-row parameter processing costs
            # more than SQLite's update itself, on every row of every tick
            sets = ", ".join(f'"{c}" = ?' for c in columns)
            json_at = columns.index("last_sample") if "last_sample" in columns else -1
            params = []
            for row in rows:
                values = [row[c] for c in columns]
                if json_at >= 0:
                    values[json_at] = json.dumps(values[json_at])  # as the JSON type stores it
                values.append(row["key"])
                params.append(tuple(values))
            conn.exec_driver_sql(f'UPDATE servers SET {sets} WHERE "key" = ?', params)
            return
        where = servers.c.key == bindparam("b_key")
        conn.execute(
            update(servers).where(where),
            [{"b_key": r["key"], **{c: r[c] for c in columns}} for r in rows],
        )

    @contextmanager
    def batch(self, preload: bool = False) -> Iterator[Store]:
        """Hold :meth:`put` writes in memory and write them in one transaction at the end.

        A tick over thousands of servers would otherwise commit once per server (one
        disk sync each on SQLite). Inside a batch, :meth:`get` and :meth:`all` see the
        held writes, and :meth:`add_event` events are held too (written before any
        later event, so ids keep the order of the calls); :meth:`delete`,
        ``put(..., now=True)``, :meth:`record_event` and notifications are written at once.
        With ``preload`` :meth:`get` answers from memory: every row is read once, by the
        first such batch, and kept up to date by this store's own writes (the service is
        the database's only writer).
        The held writes are written even when the block raises. Nested batches join
        the outer one.
        """
        if self._pending is not None:
            yield self
            return
        self._pending = {}
        if preload:
            if self._rows is None:
                with self.engine.connect() as conn:
                    self._rows = {r.key: self._row_values(r) for r in conn.execute(select(servers))}
            self._cache = self._rows
        try:
            yield self
        finally:
            pending, self._pending, stored = self._pending, None, self._cache
            try:
                self._write_rows(list(pending.values()), events_too=True, stored=stored)
            finally:
                self._cache = None

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
        if self._rows is not None:
            self._rows.pop(key, None)
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

    @staticmethod
    def _event_row(key: str, kind: str, detail: dict, now: float | None) -> dict:
        return {"time": time.time() if now is None else now, "key": key, "kind": kind,
                "detail": dict(detail or {})}  # fmt: skip

    def _take_events(self) -> list[dict]:
        held, self._held_events = self._held_events, []
        return held

    def record_event(self, key: str, kind: str, detail: dict, now: float | None = None) -> int:
        """Append an event (``state``, ``suspend``, ``suspend_failed``, ``restore``, ``warn``…).

        Returns its id, which increases with every event (a stable ``event_ref``). Events
        held by :meth:`add_event` are written first, in the same transaction.
        """
        held = self._take_events()
        with self.engine.begin() as conn:
            if held:
                conn.execute(insert(events), held)
            result = conn.execute(insert(events), self._event_row(key, kind, detail, now))
            return int(result.inserted_primary_key[0])

    def add_event(self, key: str, kind: str, detail: dict, now: float | None = None) -> None:
        """Append an event whose id the caller does not need.

        Inside :meth:`batch` it is held and written with the batch's rows (a tick with
        hundreds of state changes commits once, not once per change); outside, at once.
        """
        self._held_events.append(self._event_row(key, kind, detail, now))
        if self._pending is None:
            self._flush_events()

    def _flush_events(self) -> None:
        held = self._take_events()
        if held:
            with self.engine.begin() as conn:
                conn.execute(insert(events), held)

    def events(self, key: str | None = None, limit: int = 50) -> list[dict]:
        """The newest ``limit`` events (of one server if ``key`` is given), newest first."""
        self._flush_events()  # held ones too: readers see every event recorded so far
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
