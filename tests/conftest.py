"""Shared fixtures: a real JupyterHub (see helpers/realhub.py) and helpers for real process trees.

``hub_factory`` starts hubs from a config text and stops every one of them (servers
included) at teardown; ``hub`` is one hub with the harness defaults (simple spawner).
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import secrets
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.realhub import RealHub, free_port


@pytest.fixture
async def hub_factory(tmp_path):
    """Start real hubs: ``hub = await hub_factory(config_text, **RealHub kwargs)``.

    Each hub lives in its own folder under ``tmp_path``; all are stopped at teardown.
    """
    hubs: list[RealHub] = []

    async def make(config: str = "", **kwargs) -> RealHub:
        hub = RealHub(tmp_path / f"hub{len(hubs)}", config, **kwargs)
        hubs.append(hub)
        await hub.start()
        return hub

    yield make
    for hub in reversed(hubs):
        await hub.stop()


@pytest.fixture
async def hub(hub_factory) -> RealHub:
    """A running real hub with the harness defaults (simple spawner, dummy auth)."""
    return await hub_factory()


# ---------------------------------------------------------------- real process trees for CRIU

TREE_PROGRAM = r"""
import json, os, random, socket, subprocess, sys, time
port, logpath = int(sys.argv[1]), sys.argv[2]
state = {"secret": random.random(), "count": 0}
child = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"])
log = open(logpath, "a")
extra = []
if len(sys.argv) > 3:  # hold a stream unix socket to a peer outside the tree
    u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    u.connect(sys.argv[3])
    extra.append(u)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port))
s.listen(8)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    cmd = c.recv(100).decode().strip()
    if cmd == "inc":
        state["count"] += 1
    log.write(cmd + "\n")
    log.flush()
    reply = dict(state, pid=os.getpid(), child_alive=child.poll() is None, logpos=log.tell())
    c.sendall(json.dumps(reply).encode())
    c.close()
"""


class ProcessTree:
    """A real tree for CRIU tests: a python server (state in memory, an open file, a child).

    Query it with ``await tree.ask("get"|"inc")``. ``pid`` is the root's host pid
    (update it after a restore); teardown kills whatever tree ``pid`` names.
    """

    def __init__(
        self,
        root: Path,
        pidns: bool = False,
        unix_peer: str | None = None,
        program: str = TREE_PROGRAM,
    ):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.file = root / "data.log"
        self.stdout = root / "stdout.log"
        script = root / "tree.py"
        script.write_text(program)  # run as: program PORT LOGPATH [UNIX_PEER]
        cmd = [sys.executable, str(script), str(self.port), str(self.file)]
        if unix_peer:
            cmd.append(unix_peer)
        if pidns:
            cmd = ["unshare", "--pid", "--fork", "setsid"] + cmd
        out = open(self.stdout, "ab")
        self.proc = subprocess.Popen(
            cmd, stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=not pidns
        )
        out.close()
        self.pid = self.proc.pid
        self.pidns = pidns

    async def wait_ready(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while b"ready" not in self.stdout.read_bytes():
            assert self.proc.poll() is None or self.pidns, self.stdout.read_text()
            assert time.monotonic() < deadline, f"tree not ready: {self.stdout.read_text()}"
            await asyncio.sleep(0.05)
        if self.pidns:  # the server is the namespace's init, the child of unshare
            self.pid = psutil.Process(self.proc.pid).children()[0].pid

    async def ask(self, cmd: str = "get", timeout: float = 10) -> dict:
        async def go():
            r, w = await asyncio.open_connection("127.0.0.1", self.port)
            w.write(cmd.encode())
            await w.drain()
            data = await r.read()
            w.close()
            return json.loads(data)

        return await asyncio.wait_for(go(), timeout)

    def kill(self) -> None:
        pids = []
        try:
            p = psutil.Process(self.pid)
            pids = [self.pid] + [c.pid for c in p.children(recursive=True)]
        except psutil.Error:
            pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()


@pytest.fixture
def sleepers():
    """Factory: ``pids = sleepers(n)`` — real processes standing in for servers' kernels
    (fake drivers check they live); all killed at teardown."""
    started: list[subprocess.Popen] = []

    def make(n: int) -> list[int]:
        new = [subprocess.Popen(["sleep", "300"]) for _ in range(n)]
        started.extend(new)
        return [p.pid for p in new]

    yield make
    for p in started:
        p.kill()
        p.wait()


@pytest.fixture
def process_tree(tmp_path):
    """Factory: ``tree = process_tree(pidns=False, unix_peer=None, program=TREE_PROGRAM)``;
    all killed at teardown."""
    trees: list[ProcessTree] = []

    def make(**kwargs) -> ProcessTree:
        tree = ProcessTree(tmp_path / f"tree{len(trees)}", **kwargs)
        trees.append(tree)
        return tree

    yield make
    for tree in trees:
        tree.kill()


# ---------------------------------------------------------------- real Unix users

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def traversable():
    """Let other users reach the Hub's Python and this checkout (o+x on the folders above
    them, as an install under /opt would have): a clone under /root is 0700. Put back after."""
    changed: list[tuple[Path, int]] = []
    for target in (Path(sys.executable).resolve(), Path(sys.executable).parent, REPO):
        for folder in [target, *target.parents] if target.is_dir() else target.parents:
            mode = folder.stat().st_mode
            if not mode & stat.S_IXOTH:
                changed.append((folder, mode))
                os.chmod(folder, stat.S_IMODE(mode) | stat.S_IXOTH)
    yield
    for folder, mode in reversed(changed):
        os.chmod(folder, stat.S_IMODE(mode))


@pytest.fixture
def system_users():
    """``make()`` adds a real Unix user (useradd -m); all of them and their processes go at teardown."""
    made: list[str] = []

    def make() -> pwd.struct_passwd:
        name = f"gsu{secrets.token_hex(3)}"
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", name], check=True)
        made.append(name)
        return pwd.getpwnam(name)

    yield make
    for name in made:
        subprocess.run(["pkill", "-KILL", "-u", name], check=False)
        subprocess.run(["userdel", "-r", "-f", name], check=False, capture_output=True)
