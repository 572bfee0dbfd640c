"""The sandbox every local server runs in (jupyterhub_gpusnap/sandbox.py), with real processes.

``python -I -S sandbox.py --log FILE [--user NAME] -- CMD…`` is what the spawner starts and
JupyterHub tracks: a launcher in the host's PID namespace, an init (PID 1 of a new PID and
mount namespace, its own /proc) and the server. These tests start it exactly as the spawner
does (:func:`jupyterhub_gpusnap.sandbox.command`) and check what JupyterHub sees (the
launcher's exit status, as ``LocalProcessSpawner.poll`` reports ``Popen.poll()``), what the
server sees inside, and, with real CRIU, that ``LocalBackend`` checkpoints and restores such
a tree, refuses what CRIU cannot do before freezing anything, and waits for the old port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from jupyterhub_gpusnap import sandbox
from jupyterhub_gpusnap.checkpoint import CheckpointRefused, criu
from jupyterhub_gpusnap.checkpoint.local import LocalBackend
from jupyterhub_gpusnap.checkpoint.manifest import MANIFEST, Manifest
from jupyterhub_gpusnap.model import Server
from jupyterhub_gpusnap.procs import is_alive, is_frozen, tree_pids
from tests.helpers.realhub import free_port

PLAIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: A Python any user can run (the test's own may live under a folder only root can read).
SYSTEM_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable

#: A server holding random state in memory, answering on a TCP port with what it sees
#: inside: its pid from the namespace's /proc, its ids, the pids /proc lists. Run as
#: ``SERVER PORT [HEARTBEAT [FOLDER]]``; with a HEARTBEAT file it first starts a detached
#: job (``nohup … &`` from a shell that exits; a Python loop, which forks nothing) appending
#: to that file every 0.1 s (``-`` for none); with a FOLDER it also lists that folder.
SERVER = r"""
import json, os, random, socket, subprocess, sys
port = int(sys.argv[1])
state = {"secret": random.random(), "count": 0}
folder = sys.argv[3] if len(sys.argv) > 3 else None
if len(sys.argv) > 2 and sys.argv[2] != "-":
    job = "import sys, time\nwhile True:\n    open(sys.argv[1], 'a').write('x')\n    time.sleep(0.1)"
    subprocess.run(
        ["sh", "-c", 'nohup "$0" -c "$1" "$2" >/dev/null 2>&1 &', sys.executable, job, sys.argv[2]],
        check=True,
    )
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
    with open("/proc/self/stat") as f:
        stat_pid = int(f.read().split()[0])
    reply = dict(
        state, pid=os.getpid(), stat_pid=stat_pid, ppid=os.getppid(), uid=os.getuid(),
        gid=os.getgid(), groups=sorted(os.getgroups()),
        proc=sorted(int(d) for d in os.listdir("/proc") if d.isdigit()),
        folder=sorted(os.listdir(folder)) if folder else None,
    )
    c.sendall(json.dumps(reply).encode())
    c.close()
"""

#: A server that reports what it sees inside to its stdout (the log), starts a detached
#: ``nohup sleep 1000 &`` and waits.
INSIDE = r"""
import os, subprocess, sys, time
subprocess.run(["sh", "-c", "nohup sleep 1000 >/dev/null 2>&1 &"], check=True)
with open("/proc/self/stat") as f:
    stat_pid = int(f.read().split()[0])
print("inside", stat_pid, os.getpid(), os.getppid(), flush=True)
print("proc", " ".join(sorted((d for d in os.listdir("/proc") if d.isdigit()), key=int)), flush=True)
print("to-stderr", flush=True, file=sys.stderr)
print("ready", flush=True)
time.sleep(1000)
"""


# ---------------------------------------------------------------------- helpers


def wait_until(cond, what, timeout: float = 20.0, step: float = 0.05):
    """Poll ``cond()`` until it is truthy (returned); fail with ``what()`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(step)


async def await_until(cond, what, timeout: float = 20.0, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, what() if callable(what) else what
        await asyncio.sleep(step)


def ns_pid(pid: int) -> int:
    """The pid of host process ``pid`` in its own (innermost) PID namespace."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    raise AssertionError(f"no NSpid for {pid}")


def ids(pid: int) -> dict[str, list[int]]:
    """Real/effective/saved/fs uids and gids and the supplementary groups of ``pid``."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Uid", "Gid", "Groups"):
            found[key] = [int(v) for v in value.split()]
    return found


def ask(port: int, cmd: str = "get", timeout: float = 10) -> dict:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
        c.settimeout(timeout)
        c.sendall(cmd.encode())
        c.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := c.recv(65536):
            data += chunk
    return json.loads(data)


async def aask(port: int, cmd: str = "get") -> dict:
    return await asyncio.to_thread(ask, port, cmd)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def statuses(folder: Path) -> list[str]:
    """The status of every checkpoint manifest under ``folder``."""
    return [json.loads(p.read_text())["status"] for p in folder.rglob(MANIFEST)]


class Sandboxed:
    """One server started the way the spawner starts it: ``sandbox.command(cmd, log, user)``.

    ``proc`` is the launcher (what JupyterHub tracks), ``init`` the namespace's init (its
    only child, the spawner's ``pid``), ``server`` the command (found by its command line).
    """

    def __init__(self, root: Path, cmd: list[str], user: str | None = None):
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.cmd = cmd
        self.log = root / "server.log"
        self.launcher_out = root / "launcher.out"
        with open(self.launcher_out, "ab") as out:
            self.proc = subprocess.Popen(
                sandbox.command(cmd, str(self.log), user=user),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                cwd="/",
            )
        self.roots: list[psutil.Process] = [psutil.Process(self.proc.pid)]
        self._init: int | None = None

    def text(self) -> str:
        log = self.log.read_text(errors="replace") if self.log.exists() else "(no log)"
        out = self.launcher_out.read_text(errors="replace")
        return f"server log:\n{log}\nlauncher output:\n{out}"

    @property
    def init(self) -> int:
        if self._init is None:

            def child():
                # by its command line: the launcher's first child can be a short-lived
                # /sbin/ldconfig (ctypes.util.find_library), not yet the init
                with contextlib.suppress(psutil.Error):
                    for kid in psutil.Process(self.proc.pid).children():
                        with contextlib.suppress(psutil.Error):
                            if "--init" in kid.cmdline():
                                return kid.pid
                return None

            self._init = wait_until(
                lambda: child() or self.proc.poll() is not None and -1,
                lambda: f"no init under the launcher {self.proc.pid}; {self.text()}",
            )
            assert self._init != -1, f"launcher exited {self.proc.returncode}; {self.text()}"
            self.roots.append(psutil.Process(self._init))
        return self._init

    def server_of(self, init: int) -> int | None:
        with contextlib.suppress(psutil.Error):
            for c in psutil.Process(init).children():
                if c.cmdline() == self.cmd:
                    return c.pid
        return None

    @property
    def server(self) -> int:
        init = self.init
        return wait_until(
            lambda: self.server_of(init),
            lambda: f"no server {self.cmd} under the init {init}; {self.text()}",
        )

    def wait_log(self, text: str, timeout: float = 20) -> None:
        wait_until(
            lambda: self.log.exists() and text in self.log.read_text(errors="replace"),
            lambda: f"{text!r} never appeared in the server's log; {self.text()}",
            timeout,
        )

    def wait(self, timeout: float = 20) -> int:
        """The launcher's exit status, as ``LocalProcessSpawner.poll()`` reports it."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the launcher {self.proc.pid} still runs after {timeout}s; {self.text()}"
            ) from None

    def adopt(self, pid: int) -> None:
        """Also end the tree rooted at ``pid`` (a restored init) at teardown."""
        self.roots.append(psutil.Process(pid))

    def kill(self) -> None:
        roots = list(self.roots)
        # a restored init the test never got hold of (a failed assertion): its command line
        # names this sandbox's own log file
        for p in psutil.process_iter(["cmdline"]):
            if str(self.log) in (p.info["cmdline"] or []):
                roots.append(p)
        victims: list[psutil.Process] = []
        for root in roots:
            with contextlib.suppress(psutil.Error):
                if root.is_running():
                    victims += [root, *root.children(recursive=True)]
        for p in victims:
            with contextlib.suppress(psutil.Error):
                p.kill()
        self.proc.kill()
        self.proc.wait()
        # gone or a zombie: an orphaned init is reaped by the machine's pid 1, which may
        # take a second (waiting for that made this teardown take 2 s per sandbox)
        wait_until(
            lambda: all(dead(p) for p in victims), lambda: f"still alive: {victims}", timeout=10
        )


def dead(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def sandboxed(tmp_path):
    """Factory: ``sb = sandboxed(cmd, user=None)``; every tree (restored ones too) is
    SIGKILLed at teardown."""
    made: list[Sandboxed] = []

    def make(cmd: list[str], user: str | None = None) -> Sandboxed:
        sb = Sandboxed(tmp_path / f"sb{len(made)}", cmd, user)
        made.append(sb)
        return sb

    yield make
    for sb in made:
        sb.kill()


@pytest.fixture
def others():
    """Factory: ``p = others(argv, **popen_kwargs)``, processes outside any sandbox; killed
    (with their children) at teardown."""
    started: list[subprocess.Popen] = []

    def make(argv: list[str], **kwargs) -> subprocess.Popen:
        kwargs.setdefault("start_new_session", True)
        p = subprocess.Popen(argv, **kwargs)
        started.append(p)
        return p

    yield make
    for p in started:
        with contextlib.suppress(psutil.Error):
            for c in psutil.Process(p.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    c.kill()
        p.kill()
        p.wait()


@pytest.fixture
def system_user():
    """A real Unix user made by useradd, with a supplementary group; removed at teardown."""
    name = f"gss{secrets.token_hex(3)}"
    extra = f"{name}x"
    subprocess.run(["groupadd", extra], check=True)
    subprocess.run(
        ["useradd", "-M", "-d", "/nonexistent", "-s", "/bin/sh", "-G", extra, name], check=True
    )
    yield pwd.getpwnam(name)
    subprocess.run(["userdel", "-f", name], check=False, capture_output=True)
    subprocess.run(["groupdel", extra], check=False, capture_output=True)


@pytest.fixture
def backend(tmp_path):
    return LocalBackend(
        checkpoint_dir=str(tmp_path / "ckpt"), min_free_bytes=0, port_wait_timeout=2
    )


def python_server(sandboxed, user=None, heartbeat: Path | None = None, folder: Path | None = None):
    """A sandboxed SERVER; returns (sandbox, port) once it listens."""
    port = free_port()
    cmd = [SYSTEM_PYTHON if user else sys.executable, "-c", SERVER, str(port)]
    cmd += [str(heartbeat or "-"), *([str(folder)] if folder else [])]
    sb = sandboxed(cmd, user=user)
    sb.wait_log("ready")
    return sb, port


# ---------------------------------------------------------------------- 1. exit status


def test_exit_code_is_the_servers(sandboxed):
    sb = sandboxed(["sh", "-c", "exit 3"])
    assert sb.wait() == 3, sb.text()


@pytest.mark.parametrize("target", ["launcher", "init", "server"])
def test_a_server_killed_by_sigterm_reads_minus_15(sandboxed, target):
    # JupyterHub signals Spawner.pid, which the spawner sets to the init's host pid; an
    # admin may signal the launcher (Spawner.proc) or the server itself.
    sb = sandboxed(["sleep", "1000"])
    pid = {"launcher": sb.proc.pid, "init": sb.init, "server": sb.server}[target]
    os.kill(pid, signal.SIGTERM)
    assert sb.wait() == -signal.SIGTERM, sb.text()


def test_sigterm_to_the_init_stops_a_shell_that_does_not_exec(sandboxed):
    # sh waits for its sleep (no exec, no trap): the signal must reach sh itself (the
    # kernel drops signals to a namespace's init that it does not handle), and the sleep
    # must go with the namespace when sh dies.
    sb = sandboxed(["sh", "-c", "sleep 100; :"])
    server = sb.server
    sleep = wait_until(
        lambda: [c.pid for c in psutil.Process(server).children() if c.name() == "sleep"],
        "the shell never started its sleep",
    )[0]
    assert psutil.Process(sb.proc.pid).children() == [psutil.Process(sb.init)]
    os.kill(sb.init, signal.SIGTERM)
    assert sb.wait(timeout=20) == -signal.SIGTERM, sb.text()
    wait_until(lambda: not is_alive(sleep), "the shell's sleep outlived the stopped server")


def test_a_sigterm_sent_as_the_init_appears_is_not_lost(sandboxed):
    """A stop right after start(): the signal reaches the init before it has its handlers
    (the kernel would drop it); it must wait, blocked, and then stop the server."""
    for _ in range(5):
        sb = sandboxed(["sleep", "1000"])
        os.kill(sb.init, signal.SIGTERM)  # as soon as the init's pid is known
        assert sb.wait(timeout=10) == -signal.SIGTERM, sb.text()


def test_the_spawners_pid_is_the_init(sandboxed):
    """The launcher's only child, from its first moment, is the init (no helper process
    such as ldconfig, which once made the spawner record a pid that was gone at once)."""
    for _ in range(10):
        sb = sandboxed(["sleep", "1000"])
        kids = wait_until(lambda sb=sb: psutil.Process(sb.proc.pid).children(), "no child")
        assert [k.pid for k in kids] == [sb.init], sb.text()


def test_sigkill_of_the_server_reads_minus_9(sandboxed):
    sb = sandboxed(["sleep", "1000"])
    os.kill(sb.server, signal.SIGKILL)
    assert sb.wait() == -signal.SIGKILL, sb.text()


def test_a_signal_the_server_handles_is_passed_on_not_fatal(sandboxed):
    # SIGUSR1 to the launcher reaches the server (which traps it and exits 7): the init and
    # the launcher pass it on rather than die of it.
    sb = sandboxed(["sh", "-c", "trap 'exit 7' USR1; echo ready; while :; do sleep 0.1; done"])
    sb.wait_log("ready")
    os.kill(sb.proc.pid, signal.SIGUSR1)
    assert sb.wait() == 7, sb.text()


# ---------------------------------------------------------------------- 2. launcher killed


def test_sigkill_of_the_launcher_takes_the_whole_namespace_down(sandboxed):
    sb = sandboxed([sys.executable, "-c", INSIDE])
    sb.wait_log("ready")
    tree = tree_pids(sb.init)
    assert len(tree) >= 3, f"init, server and the detached sleep expected: {tree}"
    os.kill(sb.proc.pid, signal.SIGKILL)
    assert sb.wait() == -signal.SIGKILL
    wait_until(
        lambda: not any(is_alive(p) for p in tree),
        lambda: (
            f"processes of the sandbox outlived its launcher: {[p for p in tree if is_alive(p)]}"
        ),
    )


# ---------------------------------------------------------------------- 3. inside


def test_inside_the_sandbox(sandboxed):
    sb = sandboxed([sys.executable, "-c", INSIDE])
    sb.wait_log("ready")
    init, server = sb.init, sb.server
    lines = {ln.split()[0]: ln.split()[1:] for ln in sb.log.read_text().splitlines() if ln.strip()}
    stat_pid, getpid, ppid = (int(x) for x in lines["inside"])

    assert ns_pid(init) == 1, "the init is not PID 1 of the new namespace"
    assert psutil.Process(init).uids().real == 0
    assert ppid == 1 and ns_pid(server) == getpid, "the server is not the init's child"
    # the namespace's own /proc: /proc/self is the server itself, and /proc lists exactly
    # the namespace's processes (a host /proc would show the host pid and every process)
    assert stat_pid == getpid, f"/proc/self/stat says {stat_pid}, getpid() {getpid}"
    tree = tree_pids(init)
    inside = sorted(int(p) for p in lines["proc"])
    assert inside == sorted(ns_pid(p) for p in tree), (inside, tree)
    assert len(inside) < 10
    # its own mount namespace, /proc mounted there and not on the host
    assert sandbox.own_mount_namespace(init) and sandbox.own_mount_namespace(server)
    assert os.readlink(f"/proc/{init}/ns/pid") != os.readlink("/proc/self/ns/pid")
    # stdio: /dev/null in, the log out (both streams); nothing through the launcher
    assert os.readlink(f"/proc/{server}/fd/0") == "/dev/null"
    assert os.readlink(f"/proc/{server}/fd/1") == str(sb.log)
    assert os.readlink(f"/proc/{server}/fd/2") == str(sb.log)
    assert "to-stderr" in sb.log.read_text()
    # ... opened inside the namespace: through one of its own mounts (CRIU can follow it)
    mounts = {ln.split()[0] for ln in Path(f"/proc/{server}/mountinfo").read_text().splitlines()}
    for fd in (0, 1, 2):
        info = dict(
            ln.split(":", 1) for ln in Path(f"/proc/{server}/fdinfo/{fd}").read_text().splitlines()
        )
        assert info["mnt_id"].strip() in mounts, f"fd {fd} opened through a host mount"
    assert sandbox.unreachable_files(tree) == []
    assert "inside" not in sb.launcher_out.read_text()
    # the server runs in its own session
    assert os.getsid(server) == server

    # the detached job was reparented to the init: still in the tree CRIU dumps (once the
    # shell's child has exec'd nohup and nohup sleep: "ready" may come before that)
    def sleepers() -> list[int]:
        out = []
        for p in tree_pids(init):
            with contextlib.suppress(psutil.Error):
                if psutil.Process(p).cmdline() == ["sleep", "1000"]:
                    out.append(p)
        return out

    wait_until(sleepers, "the nohup'd sleep in the init's tree", timeout=10)
    sleeper = sleepers()
    assert len(sleeper) == 1, f"the nohup'd sleep is not in the init's tree {tree_pids(init)}"
    assert psutil.Process(sleeper[0]).ppid() == init
    # and it never escaped to the host's tree outside the sandbox
    assert psutil.Process(sb.proc.pid).children() == [psutil.Process(init)]


def test_the_server_is_pid_2(sandboxed):
    """Nothing runs in the namespace before the server (the init loads no library by
    forking ldconfig, which once took PID 2 and could pass for the init on the host)."""
    sb = sandboxed([sys.executable, "-c", INSIDE])
    sb.wait_log("ready")
    assert ns_pid(sb.server) == 2


# ---------------------------------------------------------------------- 4. --user


def test_the_server_runs_as_the_user_the_init_as_root(sandboxed, system_user):
    sb, port = python_server(sandboxed, user=system_user.pw_name)
    extra = sorted(os.getgrouplist(system_user.pw_name, system_user.pw_gid))
    assert len(extra) >= 2, "the fixture's user has a supplementary group"
    seen = ask(port)
    assert (seen["uid"], seen["gid"], seen["groups"]) == (
        system_user.pw_uid,
        system_user.pw_gid,
        extra,
    ), seen
    server = ids(sb.server)
    assert server["Uid"] == [system_user.pw_uid] * 4
    assert server["Gid"] == [system_user.pw_gid] * 4
    assert sorted(server["Groups"]) == extra
    init = ids(sb.init)
    assert init["Uid"] == [0] * 4 and init["Gid"] == [0] * 4
    assert ids(sb.proc.pid)["Uid"] == [0] * 4


def test_an_unknown_user_is_refused(sandboxed):
    sb = sandboxed(["sleep", "1000"], user="no-such-user-gss")
    assert sb.wait() == 127, sb.text()
    assert "no-such-user-gss" in sb.log.read_text()


# ---------------------------------------------------------------------- 5. missing command


def test_a_missing_command_exits_127_naming_it(sandboxed):
    sb = sandboxed(["no-such-command-gss", "--flag"])
    assert sb.wait() == 127, sb.text()
    assert "no-such-command-gss" in sb.log.read_text(), sb.text()


# ---------------------------------------------------------------------- 6. CRIU round trip


@pytest.mark.criu
async def test_checkpoint_and_restore_a_sandboxed_server(sandboxed, backend, tmp_path):
    heartbeat = tmp_path / "heartbeat"
    sb, port = python_server(sandboxed, heartbeat=heartbeat)
    init, server = sb.init, sb.server
    await aask(port, "inc")
    before = await aask(port, "inc")
    tree = tree_pids(init)
    job = [p for p in tree if p not in (init, server) and psutil.Process(p).ppid() == init]
    assert len(job) == 1, f"the detached job is not in the init's tree {tree}"
    layout = sorted(ns_pid(p) for p in tree)
    assert ns_pid(init) == 1 and before["proc"] == layout

    info = await backend.checkpoint(Server(user="alice", name="", state={"pid": init}))
    assert info.status == "verified"
    folder = backend.folder(info.id)
    m = Manifest.load(folder)
    assert m.extra["mount_namespace"] is True
    assert m.pid == init and m.port == port and sorted(m.extra["tree"]) == sorted(tree)
    # the launcher (Spawner.proc) ends, and the spawner reads it as a suspension (0)
    status = sb.wait()
    assert status == -signal.SIGKILL, sb.text()
    assert not listening(port) and not any(is_alive(p) for p in tree)
    spawner = make_spawner(tmp_path)
    spawner.proc, spawner.pid = sb.proc, init
    assert await spawner.poll() == 0
    assert spawner.pending_checkpoint["id"] == info.id and spawner.will_resume

    restored = await backend.restore(info)
    pid, ip, rport = restored.pid, restored.ip, restored.port
    sb.adopt(pid)
    assert (ip, rport) == ("127.0.0.1", port)
    after = await aask(port, "get")
    assert after["secret"] == before["secret"] and after["count"] == 2, (before, after)
    # the same PID namespace layout: the init is PID 1, the server keeps its pid (its own
    # /proc says so), the detached job too; /proc inside is still the namespace's own
    assert ns_pid(pid) == 1 and sandbox.own_mount_namespace(pid)
    # every mount of the restored namespace is the host's again: a second checkpoint
    # detaches nothing
    assert sandbox.gone_mounts(pid) == [], sandbox._mount_ids(pid)
    assert after["pid"] == before["pid"] == after["stat_pid"] and after["ppid"] == 1
    assert sorted(ns_pid(p) for p in tree_pids(pid)) == layout
    assert after["proc"] == layout
    # the detached job came back and runs
    size = heartbeat.stat().st_size
    await await_until(
        lambda: heartbeat.stat().st_size > size + 4,
        "the restored detached job does not write its heartbeat",
    )
    assert Manifest.load(folder).status == "restored"
    assert (await aask(port, "inc"))["count"] == 3


def mount_tmpfs(where: Path, source: str = "gpusnap-test") -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", source, str(where)], check=True)


@pytest.fixture
def host_tmpfs(tmp_path):
    """A tmpfs mounted on the host (as a home on NFS or the GPU driver's folder would be);
    unmounted at teardown (if still there)."""
    where = tmp_path / "host-mount"
    where.mkdir()
    mount_tmpfs(where)
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


@pytest.mark.criu
async def test_host_mounts_stay_external_to_the_checkpoint(sandboxed, backend, host_tmpfs):
    # The sandbox's mounts are copies of the host's: a checkpoint records them by path and
    # the restored server sees the host's mount again, not a copy frozen in the image.
    (host_tmpfs / "before").write_text("x")
    sb, port = python_server(sandboxed, folder=host_tmpfs)
    assert (await aask(port))["folder"] == ["before"]
    info = await backend.checkpoint(Server(user="alice", name="", state={"pid": sb.init}))
    sb.wait()
    folder = backend.folder(info.id)
    assert not list(folder.glob("tmpfs-*")), "a host tmpfs was copied into the image"
    (host_tmpfs / "after").write_text("y")  # changed on the host while suspended
    pid = (await backend.restore(info)).pid
    sb.adopt(pid)
    assert (await aask(port))["folder"] == ["after", "before"]


@pytest.mark.criu
async def test_a_mount_the_host_dropped_while_the_server_ran_is_detached_not_a_failed_restore(
    sandboxed, backend, host_tmpfs, caplog
):
    # The namespace copied the host's mounts at start; a mount the host drops later (a
    # container's root file system, an expired automount) stays in the copy, and a restore
    # that binds it again from the host fails ("Can't stat mountpoint"). Detached first.
    where = host_tmpfs
    sb, port = python_server(sandboxed)
    subprocess.run(["umount", str(where)], check=True)
    # the folder stays for now (removing a mount point detaches it everywhere); the copy
    # in the server's namespace stays mounted
    assert sandbox.gone_mounts(sb.init) == [str(where)]
    before = await aask(port, "inc")
    caplog.set_level("INFO")
    info = await backend.checkpoint(Server(user="alice", name="", state={"pid": sb.init}))
    assert info.status == "verified"
    sb.wait()
    where.rmdir()  # then the host removes the folder too (a container's bundle is deleted)
    pid = (await backend.restore(info)).pid
    sb.adopt(pid)
    after = await aask(port, "get")
    assert after["secret"] == before["secret"] and after["count"] == 1
    assert (
        f"detached 1 mount(s) the host no longer has before the checkpoint: {where}" in caplog.text
    )


def test_stand_ins_are_made_only_where_a_mount_point_is_missing_and_removed_after(tmp_path):
    there = tmp_path / "there"
    there.mkdir()
    folder, file = tmp_path / "a" / "b" / "rootfs", tmp_path / "etc" / "resolv.conf"
    points = [[str(there), True], [str(folder), True], [str(file), False], ["rel/x", True],
              [str(tmp_path / "a" / ".." / "up"), True]]  # fmt: skip
    made, stood, problems = sandbox.stand_in(points)
    assert stood == [str(folder), str(file)]
    assert made == [str(tmp_path / "a"), str(tmp_path / "a" / "b"), str(folder),
                    str(tmp_path / "etc"), str(file)]  # fmt: skip
    assert folder.is_dir() and file.is_file() and file.stat().st_mode & 0o777 == 0o600
    assert (folder.stat().st_mode & 0o777) == 0o700
    assert len(problems) == 2 and all("not an absolute, normalised path" in p for p in problems)
    assert not (tmp_path / "up").exists()
    assert sandbox.remove_stand_ins(made) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["there"]


@pytest.mark.criu
@pytest.mark.parametrize("restore_mode", ["eager", "lazy"])
async def test_a_mount_the_host_drops_after_the_checkpoint_is_stood_in_for(
    sandboxed, tmp_path, restore_mode, caplog
):
    # Another container ran beside the server (its overlay root at .../bundle/rootfs)
    # when the server was checkpointed, and is gone, bundle and all, when it is restored.
    # CRIU binds every mount of the namespace again by its path ("Can't stat mountpoint"
    # without a stand-in); nothing of the server used it, so an empty folder stands in.
    backend = LocalBackend(
        checkpoint_dir=str(tmp_path / "ckpt"),
        min_free_bytes=0,
        port_wait_timeout=2,
        restore_mode=restore_mode,
    )
    bundle = tmp_path / "bundle"
    where = bundle / "rootfs"
    where.mkdir(parents=True)
    mount_tmpfs(where)
    try:
        sb, port = python_server(sandboxed)
        before = await aask(port, "inc")
        info = await backend.checkpoint(Server(user="alice", name="", state={"pid": sb.init}))
        assert info.status == "verified"
        sb.wait()
    finally:
        subprocess.run(["umount", str(where)], check=True)
    assert [str(where), True] in Manifest.load(backend.folder(info.id)).extra["mount_points"]
    if info.id in backend.page_sums:  # a lazy restore needs the page sums, written after
        await backend.page_sums[info.id]
    subprocess.run(["rm", "-r", str(bundle)], check=True)
    caplog.set_level("INFO")
    restored = await backend.restore(info)
    sb.adopt(restored.pid)
    after = await aask(port, "get")
    assert after["secret"] == before["secret"] and after["count"] == 1
    assert "an empty folder stands in for each during the restore: " + str(where) in caplog.text
    m = Manifest.load(backend.folder(info.id))
    assert m.extra["mounts_stood_in"] == [str(where)]
    assert m.extra["restore_phases"].get("mode", "eager") == restore_mode
    # what stood in is gone from the host again, and from the restored namespace with it
    assert not bundle.exists()
    assert sandbox.gone_mounts(restored.pid) == [], sandbox._mount_ids(restored.pid)
    assert (await aask(port, "inc"))["count"] == 2


@pytest.mark.criu
async def test_a_path_the_host_mounts_anew_is_left_alone(sandboxed, backend, host_tmpfs):
    # Another file system at the same path now (or the service's own private /tmp): not
    # "gone"; the restore binds what the host has there.
    sb, port = python_server(sandboxed)
    subprocess.run(["umount", str(host_tmpfs)], check=True)
    mount_tmpfs(host_tmpfs, "gpusnap-other")
    assert sandbox.gone_mounts(sb.init) == []
    before = await aask(port, "inc")
    info = await backend.checkpoint(Server(user="alice", name="", state={"pid": sb.init}))
    sb.wait()
    sb.adopt((await backend.restore(info)).pid)
    assert (await aask(port, "get"))["secret"] == before["secret"]


@pytest.mark.criu
async def test_a_server_working_in_a_mount_the_host_dropped_is_not_suspended(
    sandboxed, backend, host_tmpfs
):
    where = host_tmpfs
    (where / "data").write_text("x")
    sb = sandboxed(["sh", "-c", f"cd {where} && sleep 1000"])
    server = sb.server
    subprocess.run(["umount", "-l", str(where)], check=True)
    with pytest.raises(CheckpointRefused) as e:
        await backend.checkpoint(Server(user="alice", name="", state={"pid": sb.init}))
    why = str(e.value)
    assert f"the host no longer has {where}" in why and f"process {server} uses {where}" in why, why
    assert "mount it on the host again" in why
    assert is_alive(server) and sb.proc.poll() is None  # left running, nothing frozen
    assert sandbox.gone_mounts(sb.init) == [str(where)]  # and left as it was


# ---------------------------------------------------------------------- 7. unreachable files

HOLDER = r"""
import json, random, socket, sys
state = {"secret": random.random(), "count": 0}
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(8)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    if c.recv(100).decode().strip() == "inc":
        state["count"] += 1
    c.sendall(json.dumps(state).encode())
    c.close()
"""


@pytest.mark.criu
@pytest.mark.parametrize("call", ["check", "checkpoint"])
async def test_a_file_opened_outside_the_mount_namespace_is_refused(
    backend, others, tmp_path, call
):
    port = free_port()
    outside = tmp_path / "opened-outside.log"
    with open(outside, "ab") as out:  # opened here, in the host's mount namespace
        unshare = others(
            ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc",
             sys.executable, "-c", HOLDER, str(port)],
            stdout=out, stderr=out, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    await await_until(
        lambda: b"ready" in outside.read_bytes(), lambda: f"not ready: {outside.read_text()}"
    )
    pid = psutil.Process(unshare.pid).children()[0].pid
    assert sandbox.own_mount_namespace(pid)
    before = await aask(port, "inc")

    with pytest.raises(CheckpointRefused) as refused:
        await getattr(backend, call)(Server(user="alice", name="", state={"pid": pid}))
    why = str(refused.value)
    assert str(outside) in why, why
    assert "outside the server's mount namespace" in why and "spawner" in why, why
    # nothing frozen, nothing dumped, the server as it was
    assert is_alive(pid) and not is_frozen(pid)
    after = await aask(port, "inc")
    assert after["secret"] == before["secret"] and after["count"] == before["count"] + 1
    assert "writing" not in statuses(backend.root)
    assert not list(backend.root.rglob("*.img"))
    assert await backend.latest("alice", "") is None


# ---------------------------------------------------------------------- 8. another user


@pytest.mark.criu
async def test_a_users_server_is_suspended_and_restored_as_the_user(
    sandboxed, backend, system_user
):
    # CRIU reads every process's resource limits; the service here lacks CAP_SYS_RESOURCE
    # (root in a container), and the CRIU .ci/install-criu.sh builds reads another user's
    # from /proc/<pid>/limits then
    sb, port = python_server(sandboxed, user=system_user.pw_name)
    before = await aask(port, "inc")
    info = await backend.checkpoint(Server(user="alice", name="", state={"pid": sb.init}))
    sb.wait()
    restored = await backend.restore(info)
    pid, rport = restored.pid, restored.port
    sb.adopt(pid)
    assert rport == port
    after = await aask(port, "inc")
    assert after["secret"] == before["secret"] and after["count"] == before["count"] + 1
    assert (after["uid"], after["gid"]) == (system_user.pw_uid, system_user.pw_gid)
    assert ids(pid)["Uid"] == [0] * 4


@pytest.mark.criu
async def test_a_criu_that_cannot_read_another_users_limits_is_refused_up_front(
    sandboxed, backend, system_user, monkeypatch
):
    # an upstream CRIU in a service without CAP_SYS_RESOURCE: prlimit on the user's
    # process fails mid-dump ("Can't get rlimit 0"), so the suspension is refused before
    # anything is frozen, naming both fixes
    monkeypatch.setattr(criu, "_has_cap_sys_resource", lambda: False)  # as here, and in CI
    monkeypatch.setitem(criu._foreign_limits, criu.find_criu(), False)
    sb, port = python_server(sandboxed, user=system_user.pw_name)
    before = await aask(port, "inc")
    server = Server(user="alice", name="", state={"pid": sb.init})
    for call in (backend.checkpoint, backend.check):
        with pytest.raises(CheckpointRefused, match="CAP_SYS_RESOURCE") as refused:
            await call(server)
        why = str(refused.value)
        assert f"uid {system_user.pw_uid}" in why and "install-criu.sh" in why, why
    assert all(not is_frozen(p) for p in tree_pids(sb.init))
    after = await aask(port, "inc")
    assert after["secret"] == before["secret"] and after["count"] == before["count"] + 1
    assert sb.proc.poll() is None
    assert "writing" not in statuses(backend.root)
    assert not list(backend.root.rglob("*.img"))


@pytest.mark.criu
async def test_the_probe_tries_the_criu_it_is_given(tmp_path, monkeypatch):
    monkeypatch.setattr(criu, "_foreign_limits", {})
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))  # the probe's folder, away from other runs
    monkeypatch.setattr(tempfile, "tempdir", None)
    # the CRIU CI installs dumps a process of the user nobody (the probe's own sleeper)
    assert await criu.reads_foreign_limits()
    # one that fails the dump (as upstream CRIU does without CAP_SYS_RESOURCE) reads as no
    fake = tmp_path / "criu"
    fake.write_text(
        '#!/bin/sh\necho "Error (criu/cr-dump.c:389): Can\'t get rlimit 0" >&2\nexit 1\n'
    )
    fake.chmod(0o755)
    assert await criu.reads_foreign_limits(str(fake)) is False
    assert criu._foreign_limits == {criu.find_criu(): True, str(fake): False}
    assert not list(scratch.iterdir())  # nothing left behind


# ---------------------------------------------------------------------- 9. waiting for the port

PORT_HOLDER = r"""
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(1)
print("ready", flush=True)
time.sleep(1000)
"""


@pytest.mark.criu
async def test_a_restore_waits_for_the_port_and_refuses_naming_its_holder(
    sandboxed, backend, others
):
    sb, port = python_server(sandboxed)
    before = await aask(port, "inc")
    info = await backend.checkpoint(Server(user="alice", name="", state={"pid": sb.init}))
    sb.wait()
    folder = backend.folder(info.id)

    holder = others([sys.executable, "-c", PORT_HOLDER, str(port)], stdout=subprocess.PIPE)
    assert holder.stdout.readline().strip() == b"ready"
    with pytest.raises(CheckpointRefused) as refused:
        await backend.restore(info)
    why = str(refused.value)
    assert f"port {port}" in why and f"pid {holder.pid}" in why, why
    assert "snapshot is kept" in why, why
    assert Manifest.load(folder).status == "verified"
    assert not list(folder.glob("restore-*.log")), "CRIU ran although the port was taken"
    assert backend.restored == {}

    holder.kill()
    holder.wait()
    restored = await backend.restore(info)
    pid, rport = restored.pid, restored.port
    sb.adopt(pid)
    after = await aask(port, "get")
    assert rport == port and after["secret"] == before["secret"] and after["count"] == 1
    assert Manifest.load(folder).status == "restored"


@pytest.mark.criu
async def test_a_restore_waits_for_the_old_tree(sandboxed, backend, others):
    # A process of the suspended tree that has not exited yet (stands in for a large
    # server still being torn down): one started before the checkpoint, named in its tree.
    old = others(["sleep", "1000"])
    sb, port = python_server(sandboxed)
    before = await aask(port, "inc")
    info = await backend.checkpoint(Server(user="alice", name="", state={"pid": sb.init}))
    sb.wait()
    folder = backend.folder(info.id)
    m = Manifest.load(folder)
    m.extra["tree"] = [*m.extra["tree"], old.pid]
    m.save(folder)

    with pytest.raises(CheckpointRefused) as refused:
        await backend.restore(info)
    why = str(refused.value)
    assert "old processes" in why and str(old.pid) in why, why
    assert Manifest.load(folder).status == "verified"
    assert not list(folder.glob("restore-*.log"))

    old.kill()
    old.wait()
    restored = await backend.restore(info)
    pid, rport = restored.pid, restored.port
    sb.adopt(pid)
    after = await aask(port, "get")
    assert rport == port and after["secret"] == before["secret"]


# ---------------------------------------------------------------------- 10. spawner command


def make_spawner(tmp_path, **traits):
    from jupyterhub import orm
    from traitlets.config import Config

    from jupyterhub_gpusnap.spawner import SnapSimpleLocalProcessSpawner

    c = Config()
    c.LocalBackend.checkpoint_dir = str(tmp_path / "ckpt")
    for k, v in traits.items():
        setattr(c.SnapSimpleLocalProcessSpawner, k, v)
    user = SimpleNamespace(name="alice", id=7, url="/user/alice/")
    hub = SimpleNamespace(
        api_url="http://hub:8081/hub/api", base_url="/hub/", url="http://hub:8081/hub/",
        public_host="",
    )  # fmt: skip
    return SnapSimpleLocalProcessSpawner(
        config=c, user=user, hub=hub, orm_spawner=orm.Spawner(name=""), _mock=True
    )


def test_server_command_finds_singleuser_next_to_the_hubs_python(tmp_path):
    here = os.path.dirname(sys.executable)
    assert os.access(os.path.join(here, "jupyterhub-singleuser"), os.X_OK)
    assert subprocess.run(
        ["sh", "-c", "command -v jupyterhub-singleuser"], env={"PATH": PLAIN_PATH},
        capture_output=True,
    ).returncode != 0, "jupyterhub-singleuser is on the plain PATH: this test proves nothing"  # fmt: skip
    spawner = make_spawner(tmp_path)
    env = {"PATH": PLAIN_PATH, "OTHER": "x"}
    cmd = spawner.server_command(env)
    assert cmd[0] == os.path.join(here, "jupyterhub-singleuser"), cmd
    assert env["PATH"] == here + os.pathsep + PLAIN_PATH
    assert env["OTHER"] == "x"

    # on the server's PATH: taken from there, PATH untouched
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    own = bin_dir / "jupyterhub-singleuser"
    own.write_text("#!/bin/sh\n")
    own.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{PLAIN_PATH}"}
    assert spawner.server_command(env)[0] == str(own)
    assert env["PATH"] == f"{bin_dir}{os.pathsep}{PLAIN_PATH}"


def test_server_command_names_a_missing_command_and_the_fix(tmp_path):
    spawner = make_spawner(tmp_path, cmd=["no-such-singleuser"])
    env = {"PATH": PLAIN_PATH}
    with pytest.raises(RuntimeError) as raised:
        spawner.server_command(env)
    why = str(raised.value)
    assert "'no-such-singleuser'" in why and PLAIN_PATH in why, why
    assert "c.Spawner.cmd" in why and "install jupyterhub" in why, why
    assert env == {"PATH": PLAIN_PATH}
