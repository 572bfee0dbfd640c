"""The few shared data types: a server as the Hub reports it, one sample of its signals, states.

One name per idea: a server is ``user/server_name`` everywhere (``alice/`` for the
default server), and :class:`State` lists the only states a server can be in.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime


class State(str, enum.Enum):
    """Per-server states of the service's state machine (transitions: :mod:`.policy`).

    A restore is not a state: the spawner restores inside the Hub's spawn, and the
    service sees the server ``suspended`` until it runs again, then ``active``.
    ``exempt``: a rule exempts it, or an admin did (``ServerStatus.exempt``).
    """

    active = "active"
    idle = "idle"
    warned = "warned"
    parked = "parked"
    suspending = "suspending"
    suspended = "suspended"
    failed = "failed"
    exempt = "exempt"

    def __str__(self) -> str:  # so f-strings and logs print "idle", not "State.idle"
        return self.value


def server_key(user: str, name: str = "") -> str:
    """The one identifier of a server: ``user/server_name`` (``alice/`` for the default)."""
    return f"{user}/{name}"


def split_key(key: str) -> tuple[str, str]:
    user, _, name = key.partition("/")
    return user, name


@dataclass
class Server:
    """A running server, as listed by the Hub API (``GET /users?state=ready``)."""

    user: str
    name: str = ""
    url: str = ""  # prefix path, e.g. /user/alice/
    started: datetime | None = None
    last_activity: datetime | None = None  # Hub's view: weak signal (websocket heartbeats move it)
    state: dict = field(
        default_factory=dict
    )  # spawner state (pid for local spawners); needs admin:server_state
    groups: list[str] = field(default_factory=list)
    profile: str = ""  # user_options.profile for KubeSpawner profile lists
    ready: bool = True
    pending: str | None = None
    admin: bool = False

    @property
    def key(self) -> str:
        return server_key(self.user, self.name)

    @property
    def pid(self) -> int | None:
        pid = self.state.get("pid") if self.state else None
        return int(pid) if pid else None


@dataclass
class Sample:
    """One observation of a server's signals at ``time`` (seconds since the epoch).

    ``None`` means "this signal has nothing to say" (no GPU, source down), never "idle".
    The policy decides from these fields alone.
    """

    time: float
    # Jupyter (through the proxy, with no_track_activity=1)
    kernels: int | None = None
    kernels_busy: int | None = None
    terminals: int | None = None
    jupyter_last_activity: float | None = None  # newest kernel/terminal activity, epoch seconds
    # CPU: percent of one core used by the server's processes since the previous sample
    cpu_percent: float | None = None
    # GPU: SM utilisation percent of the server's processes; memory held (not activity)
    gpu_percent: float | None = None
    gpu_memory_bytes: int | None = None
    gpu_count: int | None = None
    # the user's last key, click or scroll in a visible JupyterLab tab, as the Lab extension
    # reported it (epoch seconds); its own signal, with its own window in the policy
    last_interaction: float | None = None
    # Hub's last_activity (weak; counts browser heartbeats)
    hub_last_activity: float | None = None
    errors: dict[str, str] = field(default_factory=dict)  # signal name -> why it said nothing

    def merge(self, other: Sample) -> Sample:
        """Fill the fields ``other`` knows into this sample (later sources win)."""
        for name in self.__dataclass_fields__:
            if name in ("time", "errors"):
                continue
            value = getattr(other, name)
            if value is not None:
                setattr(self, name, value)
        self.errors.update(other.errors)
        return self

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}
