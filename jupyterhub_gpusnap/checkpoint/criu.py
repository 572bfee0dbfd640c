"""Async wrappers over the ``criu`` binary: version check, dump, restore.

Only what the local backend needs, with the options found necessary on real
machines (see the project's notes on CRIU):

- ``--tcp-close`` by default: established TCP connections are dropped rather
  than frozen; ZMQ (kernels) and the Hub reconnect. With it the dump passes
  ``--network-lock skip``: nothing to lock, and neither dump nor restore touches
  the host's firewall (on a host with a large nftables ruleset each lock or unlock
  costs 0.4-0.5 s). ``tcp="established"`` keeps them (with ``--network-lock
  nftables``, since these machines have no iptables binary).
- ``--file-locks`` (a held flock would make the dump fail) and
  ``--skip-in-flight`` (a listener with unaccepted connections).
- ``--leave-stopped`` at dump: the tree stays frozen until the caller has
  verified the image; then it kills it, or on failure sends SIGCONT and the
  server goes on as if nothing happened.
- ``--shell-job`` only when the root is not its own session leader.

Each call writes its own log into the image folder (``dump.log``,
``restore-<time>.log``), kept for diagnosis; errors raise
:class:`~.base.CheckpointError` carrying the tail of that log.

A restore runs ``criu restore`` *without* ``--restore-detached``: criu stays
the parent of the restored tree and reaps it when it exits, so a restored
server never lingers as a zombie under PID 1 (whose reaping is not ours to
rely on). The caller keeps the returned :class:`Restored` handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .base import CheckpointError, CheckpointRefused

INSTALL_HINT = (
    "install CRIU >= {min} with .ci/install-criu.sh (builds CRIU 4.2.1 from source; "
    "distribution packages older than 4.2 fail on recent kernels) or set LocalBackend.criu_path"
)

# Harmless on every dump/restore on these kernels; never the reason for a failure.
_NOISE = re.compile(r"rlimit: Can't setup RLIMIT_NOFILE")

TCP_MODES = ("close", "established")


def find_criu(path: str = "") -> str | None:
    """Absolute path of the criu binary: ``path`` if given, else from PATH or /usr/local/sbin."""
    if path:
        return path if os.access(path, os.X_OK) else shutil.which(path)
    return shutil.which("criu") or next(
        (p for p in ("/usr/local/sbin/criu", "/usr/sbin/criu") if os.access(p, os.X_OK)), None
    )


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


async def criu_version(criu: str = "") -> str | None:
    """The installed CRIU version (``"4.2.1"``), or None when there is no usable binary."""
    binary = find_criu(criu)
    if not binary:
        return None
    try:
        proc = await asyncio.create_subprocess_exec(
            binary, "--version", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 20)
    except (OSError, asyncio.TimeoutError):
        return None
    m = re.search(r"Version:\s*([0-9][0-9.]*)", out.decode(errors="replace"))
    return m.group(1) if m else None


async def require_criu(criu: str = "", min: str = "4.2") -> str:
    """Return the CRIU version, or raise :class:`CheckpointRefused` naming the fix.

    Also refuses when not running as root: CRIU needs CAP_SYS_ADMIN and ptrace rights
    over the server's processes.
    """
    version = await criu_version(criu)
    hint = INSTALL_HINT.format(min=min)
    if version is None:
        raise CheckpointRefused(f"CRIU not found ({criu or 'criu on PATH'}): {hint}")
    if _version_tuple(version) < _version_tuple(min):
        raise CheckpointRefused(f"CRIU {version} is too old (need >= {min}): {hint}")
    if os.geteuid() != 0:
        raise CheckpointRefused("CRIU needs root: run the service (and the Hub) as root")
    if not _has_cap_sys_resource():
        await reads_foreign_limits(criu)  # what limits_unreadable() then asks
    return version


def log_tail(path: Path | str, lines: int = 15) -> str:
    """The last ``lines`` meaningful lines of a CRIU log (errors first if there are any)."""
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    text = [line for line in text if not _NOISE.search(line)]
    errors = [line for line in text if "Error" in line]
    picked = errors[-lines:] if errors else text[-lines:]
    return "\n".join(picked)


def _tcp_args(tcp: str, restore: bool) -> list[str]:
    if tcp == "close":
        # Nothing to lock: the restore closes the connections. Without "skip" (the default
        # method, or nftables from /etc/criu/default.conf, is recorded in the image) dump
        # and restore each run `nft delete table` on the host, which reads the host's whole
        # ruleset first: 0.4-0.5 s each on a host with a large one (a Kubernetes node).
        return ["--tcp-close"] + ([] if restore else ["--network-lock", "skip"])
    if tcp == "established":
        return ["--tcp-established"] + ([] if restore else ["--network-lock", "nftables"])
    raise ValueError(f"tcp mode must be one of {TCP_MODES}, not {tcp!r}")


def needs_shell_job(pid: int) -> bool:
    """True when ``pid`` is not its own session leader (CRIU then needs ``--shell-job``)."""
    try:
        return os.getsid(pid) != pid
    except OSError:
        return False


async def dump(
    pid: int,
    directory: Path | str,
    *,
    criu: str = "",
    tcp: str = "close",
    leave_stopped: bool = True,
    file_locks: bool = True,
    skip_in_flight: bool = True,
    extra: list[str] | tuple[str, ...] = (),
    log_name: str = "dump.log",
    timeout: float = 3600,
) -> Path:
    """Dump the process tree rooted at ``pid`` into ``directory``; return the log's path.

    With ``leave_stopped`` (the default) the tree stays frozen after a successful dump.
    On failure CRIU resumes the tree itself; a :class:`CheckpointError` carries the log tail.
    """
    binary = find_criu(criu)
    if not binary:
        raise CheckpointRefused(f"CRIU not found: {INSTALL_HINT.format(min='4.2')}")
    directory = Path(directory)
    args = [binary, "dump", "-t", str(pid), "-D", str(directory), "-o", log_name, "-v4"]
    args += _tcp_args(tcp, restore=False)
    if leave_stopped:
        args.append("--leave-stopped")
    if file_locks:
        args.append("--file-locks")
    if skip_in_flight:
        args.append("--skip-in-flight")
    if needs_shell_job(pid):
        args.append("--shell-job")
    args += list(extra)
    proc = await asyncio.create_subprocess_exec(
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        preexec_fn=lambda: os.umask(0o077),
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise CheckpointError(
            f"criu dump of pid {pid} took longer than {timeout:g}s and was stopped; "
            f"log: {directory / log_name}"
        ) from None
    log = directory / log_name
    if proc.returncode != 0:
        detail = log_tail(log) or out.decode(errors="replace")[-2000:]
        raise CheckpointError(
            f"criu dump of pid {pid} failed (exit {proc.returncode}); log {log}:\n{detail}"
        )
    return log


@dataclass
class Restored:
    """A restored tree: its root's host ``pid`` and the ``criu restore`` process that reaps it."""

    pid: int
    criu: subprocess.Popen
    log: Path

    def reap(self) -> int | None:
        """Collect criu's exit status once the tree is gone (None while it runs)."""
        return self.criu.poll()


async def restore(
    directory: Path | str,
    pidfile: Path | str,
    *,
    criu: str = "",
    tcp: str = "close",
    file_locks: bool = True,
    shell_job: bool = False,
    extra: list[str] | tuple[str, ...] = (),
    log_name: str | None = None,
    timeout: float = 600,
    cgroup: Path | str | None = None,
    inherit: list[tuple[str, str]] | tuple[tuple[str, str], ...] = (),
) -> Restored:
    """Restore the tree in ``directory``; return once it runs, with its root's host pid.

    ``criu restore`` keeps running as the tree's parent (see the module docstring).
    ``cgroup``: a cgroup v2 folder that ``criu restore`` is started in (the child writes
    its pid into ``<cgroup>/cgroup.procs`` before it execs criu), so every restored task
    is born there and its memory is charged there; pass ``--manage-cgroups=ignore`` in
    ``extra`` to keep CRIU from moving tasks back to the checkpointed cgroups.
    ``inherit``: ``(path, key)`` pairs, each path opened (namespaces read-only, the rest
    read-write) and handed to CRIU as ``--inherit-fd fd[N]:key`` (a container's network
    namespace, its stdio pipes: the node agent's restore into a placeholder).
    Raises :class:`CheckpointError` with the log tail when the restore fails.
    """
    binary = find_criu(criu)
    if not binary:
        raise CheckpointRefused(f"CRIU not found: {INSTALL_HINT.format(min='4.2')}")
    directory = Path(directory)
    pidfile = Path(pidfile)
    pidfile.unlink(missing_ok=True)
    log_name = log_name or time.strftime("restore-%Y%m%dT%H%M%SZ.log", time.gmtime())
    args = [binary, "restore", "-D", str(directory), "-o", log_name, "-v4"]
    args += ["--pidfile", str(pidfile)]
    args += _tcp_args(tcp, restore=True)
    if file_locks:
        args.append("--file-locks")
    if shell_job:
        args.append("--shell-job")
    enter = None
    if cgroup is not None:
        procs = Path(cgroup) / "cgroup.procs"
        if not os.access(procs, os.W_OK):
            raise CheckpointError(
                f"cannot start criu restore in cgroup {cgroup}: {procs} is not writable; "
                "mount the cgroup v2 hierarchy read-write and run as root"
            )
        enter = _enter_cgroup(str(procs))
    fds: list[int] = []
    try:
        for path, key in inherit:
            try:
                fd = os.open(path, os.O_RDONLY if "/ns/" in path else os.O_RDWR)
            except OSError as e:
                raise CheckpointError(f"cannot open {path} to hand to CRIU as {key}: {e}") from e
            fds.append(fd)
            args += ["--inherit-fd", f"fd[{fd}]:{key}"]
        args += list(extra)
        # Popen, not an asyncio subprocess: an asyncio transport kills its child when it is
        # closed or collected, and this child must outlive the caller's event loop.
        try:
            proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
                pass_fds=fds,
                preexec_fn=enter,
            )
        except subprocess.SubprocessError as e:  # the preexec_fn failed: nothing was started
            raise CheckpointError(f"cannot start criu restore in cgroup {cgroup}: {e}") from e
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    log = directory / log_name
    deadline = time.monotonic() + timeout
    while True:
        status = proc.poll()
        pid = read_pidfile(pidfile)
        if pid and status is None and _finished(log):
            return Restored(pid=pid, criu=proc, log=log)
        if status is not None:
            raise CheckpointError(
                f"criu restore from {directory} failed (exit {status}); log {log}:\n{log_tail(log)}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise CheckpointError(
                f"criu restore from {directory} took longer than {timeout:g}s and was stopped; log {log}"
            )
        await asyncio.sleep(0.02)


def _enter_cgroup(procs: str):
    """A ``preexec_fn`` that moves the forked child into the cgroup owning ``procs``.

    Runs between fork and exec: only a raw write of ``0`` (the writer itself).
    """
    data = b"0"

    def enter() -> None:
        fd = os.open(procs, os.O_WRONLY)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    return enter


def _finished(log: Path) -> bool:
    """True once criu logged that the restored tasks run (the pidfile is written earlier)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.path.getsize(log) - 4096))
            return b"Restore finished successfully" in f.read()
    except OSError:
        return False


def read_pidfile(pidfile: Path) -> int | None:
    """The pid CRIU wrote to ``--pidfile`` (None if absent or not a number)."""
    try:
        text = pidfile.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


CAP_SYS_RESOURCE = 24


def _ids(pid: int | str) -> tuple[set[str], set[str], int]:
    """(uids, gids, effective capabilities) of a process, from /proc/<pid>/status."""
    uids: set[str] = set()
    gids: set[str] = set()
    caps = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == "Uid":
                uids = set(value.split()[:3])
            elif key == "Gid":
                gids = set(value.split()[:3])
            elif key == "CapEff":
                caps = int(value.strip(), 16)
    return uids, gids, caps


#: Whether the CRIU that :func:`require_criu` last checked can dump another user's
#: process without CAP_SYS_RESOURCE (None: not probed, or not needed).
_foreign_limits: dict[str, bool] = {}


def _has_cap_sys_resource() -> bool:
    return bool(_ids("self")[2] >> CAP_SYS_RESOURCE & 1)


async def reads_foreign_limits(criu: str = "") -> bool:
    """Can this CRIU dump a process of another user without CAP_SYS_RESOURCE?

    Upstream CRIU reads every process's resource limits with prlimit, which the kernel
    allows for another user's process only with CAP_SYS_RESOURCE; the CRIU that
    .ci/install-criu.sh builds reads them from /proc/<pid>/limits then. Tried, not
    guessed: a throwaway ``sleep`` of the user nobody is dumped with --leave-running
    into a temporary folder. Cached per binary.
    """
    binary = find_criu(criu)
    if not binary:
        return False
    if binary in _foreign_limits:
        return _foreign_limits[binary]
    import tempfile

    ok = False
    try:
        sleeper = await asyncio.create_subprocess_exec(
            "sleep",
            "60",
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            user=65534,
            group=65534,
            extra_groups=[],
        )
    except (OSError, subprocess.SubprocessError):
        return False
    try:
        with tempfile.TemporaryDirectory(prefix="gpusnap-criu-probe-") as d:
            proc = await asyncio.create_subprocess_exec(
                binary,
                "dump",
                "-t",
                str(sleeper.pid),
                "-D",
                d,
                "--leave-running",
                "-o",
                "dump.log",
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            ok = await asyncio.wait_for(proc.wait(), 60) == 0
    except (OSError, asyncio.TimeoutError):
        ok = False
    finally:
        sleeper.kill()
        await sleeper.wait()
    _foreign_limits[binary] = ok
    return ok


def limits_unreadable(pids: list[int], criu: str = "") -> str:
    """Why CRIU (run by this process) cannot dump ``pids``, or ''.

    CRIU reads every process's resource limits (prlimit), which the kernel allows for a
    process of another user only with CAP_SYS_RESOURCE. Hosts give root that capability;
    some containers drop it, and then only a CRIU that reads the limits from /proc
    (:func:`reads_foreign_limits`, probed by :func:`require_criu`) can dump servers
    running as Unix users.
    """
    if _has_cap_sys_resource():
        return ""
    my_uids, my_gids, _ = _ids("self")
    binary = find_criu(criu)
    if binary and _foreign_limits.get(binary):
        return ""
    for pid in pids:
        try:
            uids, gids, _ = _ids(pid)
        except OSError:
            continue
        if uids != my_uids or gids != my_gids:
            return (
                f"process {pid} runs as uid {'/'.join(sorted(uids))}, and this CRIU cannot read the "
                "resource limits of another user's process without CAP_SYS_RESOURCE, which this "
                "service lacks (its container or unit drops it): install CRIU with "
                ".ci/install-criu.sh (it reads them from /proc/<pid>/limits), or give the service "
                "and the Hub CAP_SYS_RESOURCE (docker/podman: --cap-add SYS_RESOURCE; systemd: "
                "CapabilityBoundingSet), or run servers as root"
            )
    return ""


#: The lazy-restore patches of .ci/criu-patches, each with a message of its own that a
#: CRIU built with it holds (.ci/install-criu.sh checks the same strings). Without them a
#: lazy restore is slow (0002-0005, 0007) or wrong: a process that moves or gives back
#: memory while its pages arrive never finishes (0008) or reads zero-filled pages at the
#: new place (0009); a stack page left lazy (0006); pages sent twice while a process
#: changes its memory map (0010); a child forked while an answer was copied left unserved,
#: reading zero-filled pages once the parent's were in (0014).
LAZY_PATCHES = {
    "0002-lazy-pages-larger-transfers": "#PF at 0x%llx: asking for %llu bytes, background stays at %lu",
    "0003-lazy-pages-pipelined-transfer": "background: %lu pages at 0x%lx, up to %d requests in flight",
    "0004-lazy-pages-faults-first": "answer for 0x%lx of %lu taken ahead of %d earlier requests",
    "0005-lazy-pages-fault-around": "fault-around: %lu pages at 0x%lx",
    "0006-mem-lazy-stack-page": "page at %lx holds a stack pointer: not lazy",
    "0007-lazy-pages-merged-runs": "runs of pages merged: the longest is %lu bytes",
    "0008-lazy-pages-drop-unmapped-ranges": "dropping %llu bytes of ranges at %llx",
    "0009-lazy-pages-remap-requests-in-flight": "remap: %d requests in flight asked for again at the new place",
    "0010-lazy-pages-copy-again-after-map-change": "copy refused while the memory map changed",
    "0014-lazy-pages-follow-forks-read-while-copying": "lazy-pages: following a forked process",
}  # fmt: skip

# Copier threads (LocalBackend.lazy_copiers): a speed-up, not needed for a lazy restore
COPIER_PATCHES = {"0011-lazy-pages-copiers": "copier: %d events read while waiting for a buffer"}
# Answers in shared memory (LocalBackend.lazy_shared_mib): a speed-up, not needed either
SHARED_PATCHES = {"0012-lazy-pages-shared-answers": "lazy-pages: answers in shared memory of %lu bytes"}  # fmt: skip
# The daemon sleeps while it has nothing to ask for (upstream it polled, taking a core)
IDLE_PATCHES = {"0013-lazy-pages-idle-wait": "lazy-pages: slept %lu times while nothing was to ask for"}  # fmt: skip
#: The daemon maps pages a pagemap flags PE_ZERO as zero pages (lazy.stage's zero_pages)
ZERO_PATCHES = {"0015-lazy-pages-zero-pages": "lazy-pages: %lu zero pages mapped, not asked for"}  # fmt: skip
#: 32 background requests in flight per process, not 8: the short runs of pages between holes
#: (a Python heap's) come in fewer round trips
DEPTH_PATCHES = {"0016-lazy-pages-more-requests-in-flight": "lazy-pages: up to %d background requests in flight"}  # fmt: skip

_lazy_missing: dict[tuple, set[str]] = {}


def lazy_patches_missing(criu: str = "", patches: dict[str, str] | None = None) -> list[str]:
    """The patches of ``patches`` (default :data:`LAZY_PATCHES`) the criu binary lacks (all
    of them when it cannot be found or read). The binary is read once per path, size and
    change time, for every patch of LAZY_PATCHES, COPIER_PATCHES, SHARED_PATCHES,
    IDLE_PATCHES, ZERO_PATCHES and DEPTH_PATCHES."""
    patches = LAZY_PATCHES if patches is None else patches
    binary = find_criu(criu)
    if not binary:
        return list(patches)
    try:
        real = os.path.realpath(binary)
        st = os.stat(real)
        key = (real, st.st_size, st.st_mtime_ns)
        if key not in _lazy_missing:
            with open(real, "rb") as f:
                data = f.read()
            known = {**LAZY_PATCHES, **COPIER_PATCHES, **SHARED_PATCHES, **IDLE_PATCHES,
                     **ZERO_PATCHES, **DEPTH_PATCHES}  # fmt: skip
            _lazy_missing[key] = {n for n, m in known.items() if m.encode() not in data}
        return [n for n in patches if n in _lazy_missing[key]]
    except OSError:
        return list(patches)


def lazy_patches_lacking(criu: str = "") -> str:
    """'' when the criu binary has every patch of :data:`LAZY_PATCHES`, else which it
    lacks ("/usr/sbin/criu lacks the lazy-restore patches 0002, 0003 of .ci/criu-patches")."""
    missing = lazy_patches_missing(criu)
    if not missing:
        return ""
    return (
        f"{find_criu(criu) or 'criu'} lacks the lazy-restore patches "
        f"{', '.join(p[:4] for p in missing)} of .ci/criu-patches"
    )


async def start_lazy_pages(
    directory: Path | str,
    ps_socket: int,
    *,
    criu: str = "",
    log_name: str = "lazy-pages.log",
    timeout: float = 60,
    copiers: int | None = None,
    shared_fd: int | None = None,
) -> subprocess.Popen:
    """Start ``criu lazy-pages`` for the image in ``directory``; return once it listens.

    The daemon fetches pages from a page server over ``ps_socket``, a connected stream
    socket inherited as is (``--page-server --ps-socket FD``: no TCP port another user
    could reach); ``--status-fd`` tells when its socket for ``criu restore --lazy-pages``
    (``lazy-pages.socket`` in ``directory``) is ready. It runs in its own session, is not
    detached (the caller reaps it: its exit status says whether every page arrived) and
    logs to ``<directory>/<log_name>``. ``copiers``: how many threads copy the pages it
    receives into the processes (``CRIU_LAZY_COPIERS``, patch 0011; None: CRIU's default,
    4). ``shared_fd``: a memfd the page server puts its answers' pages in
    (``CRIU_LAZY_SHM_FD``, patch 0012; the daemon then has no copiers). Raises
    :class:`CheckpointError` with the log tail if it does not get ready.
    """
    binary = find_criu(criu)
    if not binary:
        raise CheckpointRefused(f"CRIU not found: {INSTALL_HINT.format(min='4.2')}")
    directory = Path(directory)
    ready_r, ready_w = os.pipe()
    args = [
        binary, "lazy-pages", "-D", str(directory), "-o", log_name, "-v4",
        "--page-server", "--ps-socket", str(ps_socket), "--status-fd", str(ready_w),
    ]  # fmt: skip
    ours = {"CRIU_LAZY_COPIERS": copiers, "CRIU_LAZY_SHM_FD": shared_fd}
    ours = {k: str(v) for k, v in ours.items() if v is not None}
    try:
        proc = subprocess.Popen(
            args,
            env={**os.environ, **ours} if ours else None,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            pass_fds=[fd for fd in (ps_socket, ready_w, shared_fd) if fd is not None],
        )
    finally:
        os.close(ready_w)
    loop = asyncio.get_running_loop()
    ready: asyncio.Future = loop.create_future()

    def on_ready() -> None:  # a \0, or EOF when the daemon exits first
        if not ready.done():
            ready.set_result(os.read(ready_r, 1))

    loop.add_reader(ready_r, on_ready)
    try:
        got = await asyncio.wait_for(ready, timeout)
    except asyncio.TimeoutError:
        got = None
    finally:
        loop.remove_reader(ready_r)
        os.close(ready_r)
    if got != b"\0":
        if proc.poll() is None:
            proc.kill()
        status = await asyncio.to_thread(proc.wait)
        log = directory / log_name
        raise CheckpointError(
            f"criu lazy-pages for {directory} did not start (exit {status}); log {log}:\n{log_tail(log)}"
        )
    return proc
