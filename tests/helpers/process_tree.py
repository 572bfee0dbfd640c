"""Real process trees for the CRIU tests: a python server with state in memory, an open
file and a child, which a test queries over TCP before and after a checkpoint."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.helpers.realhub import free_port

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

# The test tree holding 4 MiB that every copy of it holds alike (a model's weights, say):
# two servers' snapshots then share those chunks. Every answer carries their sha256.
SHARED_TREE = TREE_PROGRAM.replace(
    'state = {"secret"',
    'import hashlib\nweights = random.Random(7).randbytes(4 << 20)\nstate = {"secret"',
).replace("reply = dict(state,", "reply = dict(state, weights=hashlib.sha256(weights).hexdigest(),")


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
        # Its own working folder: a tree in its own PID namespace has the host's /proc, so
        # CRIU's parasite mounts a proc of its own at "proc.crtools" in the task's working
        # folder, a fixed name; two trees dumped at once from one folder (the suite's two
        # workers) collided there ("Can't create a directory (-17)").
        self.proc = subprocess.Popen(
            cmd, stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=not pidns,
            cwd=root,
        )  # fmt: skip
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
