"""Free TCP ports on 127.0.0.1 for the real servers the tests start."""

from __future__ import annotations

import os
import random
import socket

_given: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, below the kernel's
    ephemeral range: a port from that range, released, can be handed to any outgoing
    connection (or to JupyterHub's own random_port) before the server that asked for it
    binds it, which made a service fail with "Address already in use". Below the ports
    the spawner picks single-user servers' ports from (procs.server_port), so a test's
    server never takes the port a spawned server is about to bind. Never the same port
    twice in one test run."""
    # imported here: .ci/install-runtime.sh loads this module (worker_share) before the
    # package's dependencies are installed
    from jupyterhub_gpusnap.procs import SERVER_PORTS, ephemeral_low

    low = min(ephemeral_low(), 61000) - SERVER_PORTS
    start, end = worker_share(max(1024, low - 10000), low)
    for _ in range(200):
        port = random.randrange(start, end)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    with socket.socket() as s:  # below the range is full: fall back to the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_share(start: int, end: int) -> tuple[int, int]:
    """This test process's slice of ``[start, end)``: with pytest-xdist each worker (gw0,
    gw1, …) takes ports (and pod sandbox addresses) from its own slice, so two workers
    never hand out the same one before it is taken."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or count < 2:
        return start, end
    i = int(worker[2:]) % count
    width = (end - start) // count
    return start + i * width, start + (i + 1) * width
