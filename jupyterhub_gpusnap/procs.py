"""A server's processes: its tree, whether one runs or is frozen, what it listens on — the
helpers every part that looks at processes shares."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import time

import psutil


def tree_pids(root_pid: int | None) -> list[int]:
    """``root_pid`` and all its descendants, root first; [] when it is gone.

    A notebook server's work happens in its kernels (children), so signals, parking and
    checkpoints all cover the whole tree.
    """
    if not root_pid:
        return []
    try:
        root = psutil.Process(root_pid)
        return [root.pid] + [c.pid for c in root.children(recursive=True)]
    except psutil.Error:
        return []


def boot_clock() -> dict:
    """Now, on the clock process start times are kept in: seconds since this boot
    (``CLOCK_BOOTTIME``) and the boot's id. Wall-clock time cannot be compared with a
    process's start (psutil derives that from ``btime``, whole seconds)."""
    return {"boot_id": _boot_id(), "since_boot": time.clock_gettime(time.CLOCK_BOOTTIME)}


def started_since(pid: int, stamp: dict) -> bool | None:
    """True if ``pid`` started at or after ``stamp`` (from :func:`boot_clock`), False if
    before, None if that cannot be told (gone, or another boot)."""
    if not stamp or stamp.get("boot_id") != _boot_id():
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[19])  # starttime, field 22: clock ticks after boot
    except (OSError, IndexError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    return ticks >= int(float(stamp["since_boot"]) * hz)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def is_alive(pid: int) -> bool:
    """True if ``pid`` runs (or is stopped); a zombie counts as dead."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def is_frozen(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def environ_of(pid: int, name: str) -> str:
    """One variable of the environment ``pid`` started with ('' if unknown)."""
    try:
        return psutil.Process(pid).environ().get(name, "")
    except psutil.Error:
        return ""


def listen_address(pid: int) -> tuple[str, int]:
    """The (ip, port) the server in the tree of ``pid`` listens on: the first process,
    root first and then by depth, that listens (the sandbox's init never does, the
    Jupyter server does before its kernels)."""
    for p in tree_pids(pid):
        try:
            conns = psutil.Process(p).net_connections(kind="tcp")
        except psutil.Error:
            continue
        listening = sorted(
            (c.laddr.port, c.laddr.ip) for c in conns if c.status == psutil.CONN_LISTEN
        )
        if listening:
            port, ip = listening[0]
            return ip, port
    return "", 0


def can_listen(ip: str, port: int) -> bool:
    """Whether a server could listen on ``ip:port`` now (``""`` means every address)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True


def port_holder(ip: str, port: int) -> str | None:
    """None if ``ip:port`` can be listened on now, else who holds it ("pid N (name)")."""
    if can_listen(ip if ip not in ("", "0.0.0.0") else "127.0.0.1", port):
        return None
    with contextlib.suppress(psutil.Error, OSError):
        for c in psutil.net_connections(kind="tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                return f"pid {c.pid} ({psutil.Process(c.pid).name()})"
    return "another process"


SERVER_PORTS = 10000
"""How many ports below the kernel's ephemeral range :func:`server_port` picks from."""


def ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (``ip_local_port_range``)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def server_port(ip: str, reserved: set[int] = frozenset()) -> int:
    """A port for a new single-user server: free on ``ip`` now, not in ``reserved``, and
    in the :data:`SERVER_PORTS` ports just below the kernel's ephemeral range.

    JupyterHub's own ``random_port`` asks the kernel for an ephemeral port and releases
    it; the server binds it a second or so later. Every Jupyter kernel's ZeroMQ sockets and
    every outgoing connection take ports from that same range, so in between a kernel of
    another server could take it: the new server then fails with "Address already in use"
    and the Hub waits on a port that answers in ZeroMQ. Below the range only programs
    that name a port bind, and the pick is random among thousands.
    """
    high = min(ephemeral_low(), 65536)
    low = max(1024, high - SERVER_PORTS)
    for _ in range(200 if high - low >= 100 else 0):  # no room below a range set that low
        port = random.randrange(low, high)
        if port not in reserved and can_listen(ip, port):
            return port
    # that whole span taken: fall back to an ephemeral port, as JupyterHub would
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in reserved:
            return port
