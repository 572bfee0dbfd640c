"""The sandbox every local server runs in: one that both CUDA and CRIU accept.

The spawner starts ``python sandbox.py --log FILE [--user NAME] -- COMMAND…`` (see
:func:`command`); CRIU dumps and restores the tree with :func:`dump_args` /
:func:`restore_args`. Three processes, each with one job:

``launcher``
    The process JupyterHub starts and tracks (``Spawner.proc``), in the host's PID
    namespace. It makes a new mount and PID namespace, forks the init, passes every
    stop signal it gets on to it, and exits the way the server did (``-15`` after a
    SIGTERM, the exit code otherwise), so ``poll()`` reads as for JupyterHub's own
    ``LocalProcessSpawner``.

``init`` (PID 1 of the new namespace, root)
    This script again, exec'd inside the new namespaces (a process forked before them
    keeps its program mapped through the host's mounts, which CRIU cannot follow).
    Mounts the namespace's own ``/proc``: without it CUDA cannot start (error 304,
    "OS call failed or operation not supported") and CRIU cannot dump a non-root
    process ("can't dump unprivileged task whose /proc doesn't belong to it"). Opens
    stdin (``/dev/null``) and the log *inside* the namespace: CRIU cannot follow a file
    opened through another mount namespace ("Can't lookup mount=… for fd=0"). Dies
    with the launcher (``PR_SET_PDEATHSIG``), so the server can never outlive what the
    Hub tracks. Passes signals on to the server (kept blocked and taken with
    ``sigtimedwait``: the kernel drops a signal sent from outside to a namespace's init
    that has no handler, but keeps a blocked one pending), adopts and reaps
    detached jobs (``nohup … &`` stays in the tree, and in the checkpoint), and exits
    with the server's status. It is the root of the tree CRIU dumps; it has no open
    files but stdio, and holds no memory worth counting.

``server``
    The command, in its own session, as the user (``--user``: groups, gid, uid
    switched inside the namespace, after the mounts that need root).

Mounts: the namespace starts as a private copy of the host's mounts. All of them (the
root file system, home directories on NFS, the GPU driver's folder, ``/dev/shm``) are
*external* to a checkpoint (``--ext-mount-map auto``) and must exist again where the
server is restored; only the namespace's ``/proc`` is its own. :func:`unreachable_files`
finds open files CRIU could not follow, so a suspension is refused before anything is
frozen (docs/sandbox.md).

This file runs as a script with ``python -I -S`` (the standard library only, no site
packages) so that the two helper processes cost a few MiB and start in milliseconds.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MS_REC, MS_PRIVATE = 0x4000, 1 << 18
PR_SET_PDEATHSIG = 1
MNT_DETACH = 2

#: The signals a stop (or an admin) sends that the server must see.
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
#: ``criu dump`` arguments for a tree in its own mount namespace: every inherited mount
#: is external (recorded by its path, bind-mounted again at restore).
MOUNT_ARGS = ("--ext-mount-map", "auto", "--enable-external-sharing", "--enable-external-masters")


# ---------------------------------------------------------------------- used by the spawner


def command(
    cmd: list[str], log: str, user: str | None = None, python: str | None = None
) -> list[str]:
    """The command line that runs ``cmd`` in the sandbox, its output appended to ``log``."""
    args = [python or sys.executable, "-I", "-S", os.path.abspath(__file__), "--log", log]
    if user is not None:
        args += ["--user", user]
    return args + ["--"] + list(cmd)


# ---------------------------------------------------------------------- used by CRIU's callers


def own_mount_namespace(pid: int) -> bool:
    """True if ``pid`` lives in a mount namespace other than this process's."""
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    except OSError:
        return False


def dump_args(pid: int) -> list[str]:
    """Extra ``criu dump`` arguments for the tree rooted at ``pid``."""
    return list(MOUNT_ARGS) if own_mount_namespace(pid) else []


def restore_args(mount_namespace: bool) -> list[str]:
    """Extra ``criu restore`` arguments for an image dumped with :func:`dump_args`."""
    return [*MOUNT_ARGS, "--root", "/"] if mount_namespace else []


def _mount_ids(pid: int | str) -> dict[int, str]:
    ids = {}
    with open(f"/proc/{pid}/mountinfo") as f:
        for line in f:
            fields = line.split()
            ids[int(fields[0])] = fields[4]
    return ids


def unreachable_files(pids: list[int]) -> list[str]:
    """Open files of ``pids`` that CRIU cannot checkpoint, each with the reason and the fix.

    A file opened through another mount namespace (a descriptor passed in from outside
    the sandbox) has a mount CRIU cannot find in the server's namespace.
    """
    problems: list[str] = []
    if not pids:
        return problems
    try:
        mounts = _mount_ids(pids[0])
    except OSError:
        return problems
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if not target.startswith("/"):
                    continue  # sockets, pipes, anonymous inodes: not on a mount
                with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                    info = dict(line.split(":", 1) for line in f if ":" in line)
                mnt_id = int(info.get("mnt_id", "-1").strip())
            except (OSError, ValueError):
                continue
            if mnt_id >= 0 and mnt_id not in mounts:
                problems.append(
                    f"process {pid} holds {target} (fd {fd}) through a mount outside the "
                    f"server's mount namespace (mount id {mnt_id}), which CRIU cannot follow: "
                    "it was passed in from outside the sandbox; start the server with "
                    "jupyterhub_gpusnap's spawner (which opens every file inside) or close it"
                )
    return problems


def _unescape(path: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        path = path.replace(code, char)
    return path


def gone_mounts(pid: int) -> list[str]:
    """Mount points in the mount namespace of ``pid`` whose mount the host no longer has.

    The namespace is a private copy of the host's mounts made when the server started:
    a mount removed from the host later (a container's root file system, an automounted
    folder that expired) stays in the copy. CRIU records every such mount by its path
    and binds the same path again at restore, which fails once the host has it no
    more, so these are detached before a dump (:func:`detach_mounts`). Only paths where
    the host (this process's mount namespace, which must be the Hub's) has no mount at
    all: a path the host mounts differently (another file system there now, a private
    /tmp of the service's own unit) is left alone, since a restore binds whatever the
    host has there. Deepest first; empty if ``pid`` shares this process's mount
    namespace.
    """
    if not own_mount_namespace(pid):
        return []
    try:
        host = set(_mount_ids("self").values())
        inside = set(_mount_ids(pid).values())
    except (OSError, ValueError, IndexError):
        return []
    gone = inside - host - {"/"}  # never the root
    return sorted(gone, key=lambda p: (-p.count("/"), p))


def mount_points(pid: int) -> list[list]:
    """Every mount point of the mount namespace of ``pid`` but its root, shallowest first,
    each ``[path, is_dir]``: what a restore binds again from the host. Kept in the
    checkpoint's manifest, so that a restore can stand in for one the host has lost since
    (:func:`stand_in`). Empty if ``pid`` shares this process's mount namespace."""
    if not own_mount_namespace(pid):
        return []
    try:
        points = set(_mount_ids(pid).values()) - {"/"}
    except (OSError, ValueError, IndexError):
        return []
    return [
        [path, os.path.isdir(f"/proc/{pid}/root{path}")]
        for path in sorted((_unescape(p) for p in points), key=lambda p: (p.count("/"), p))
    ]


def stand_in(points: list) -> tuple[list[str], list[str], list[str]]:
    """Before a restore: an empty folder (or file) where a mount point of ``points``
    (:func:`mount_points`) is missing on the host.

    A mount the host had when the server was checkpointed can be gone at its restore:
    another container's root file system on the same machine, a login session's
    ``/run/user/<uid>``. CRIU binds every mount of the namespace again from the host, by
    its path, and fails on a path that is not there ("Can't stat mountpoint"). When
    nothing of the server used what was mounted there, an empty folder lets the restore
    go on; when something did, CRIU still fails on the file it cannot find, as before.

    Returns what was made (folders and files, in the order made: remove them with
    :func:`remove_stand_ins` once the restore has bound them), the mount points stood in
    for, and the ones that could not be made, each with the reason.
    """
    made: list[str] = []
    stood: list[str] = []
    problems: list[str] = []
    for entry in points:
        try:
            path, is_dir = str(entry[0]), bool(entry[1])
        except (TypeError, IndexError, KeyError):
            problems.append(f"{entry!r}: not a [path, is_dir] pair")
            continue
        if not path.startswith("/") or os.path.normpath(path) != path:
            problems.append(f"{path!r}: not an absolute, normalised path")
            continue
        if os.path.lexists(path):
            continue
        missing = []
        parent = os.path.dirname(path)
        while not os.path.lexists(parent):
            missing.append(parent)
            parent = os.path.dirname(parent)
        try:
            for folder in reversed(missing):
                os.mkdir(folder, 0o700)
                made.append(folder)
            if is_dir:
                os.mkdir(path, 0o700)
            else:
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            made.append(path)
            stood.append(path)
        except OSError as e:
            problems.append(f"{path}: {e}")
    return made, stood, problems


def remove_stand_ins(made: list[str]) -> list[str]:
    """After a restore: remove what :func:`stand_in` made, deepest first (a folder the
    restored namespace mounts on is detached there: nothing of the server used it). The
    ones that could not be removed, each with the reason."""
    failed = []
    for path in reversed(made):
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            failed.append(f"{path}: {e}")
    return failed


def users_of(pids: list[int], mount_points: list[str]) -> list[str]:
    """What processes of ``pids`` hold under ``mount_points`` (open files, working or root
    folder, mapped files): those mounts cannot be detached."""
    held = []
    roots = [_unescape(m).rstrip("/") + "/" for m in mount_points]
    for pid in pids:
        paths = []
        for link in ("cwd", "root"):
            try:
                paths.append(os.readlink(f"/proc/{pid}/{link}"))
            except OSError:
                pass
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    paths.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    pass
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    fields = line.split(None, 5)  # the sixth, if any, is the mapped file
                    if len(fields) > 5:
                        paths.append(fields[5].strip())
        except OSError:
            pass
        for path in paths:
            if any((path + "/").startswith(root) for root in roots):
                held.append(f"process {pid} uses {path}")
    return held


def detach_mounts(pid: int, mount_points: list[str]) -> list[str]:
    """Detach ``mount_points`` (from :func:`gone_mounts`) inside the mount namespace of
    ``pid`` (``umount2(MNT_DETACH)`` in a helper process that joins it: this script with
    ``--detach``); the ones that could not be detached, each with the reason."""
    import subprocess

    paths = [_unescape(m) for m in mount_points]
    r = subprocess.run(
        [sys.executable, "-I", "-S", os.path.abspath(__file__), "--detach", str(pid), *paths],
        capture_output=True,
        text=True,
        check=False,
    )
    failed = [line for line in r.stdout.splitlines() if line]
    if r.returncode != 0 and not failed:
        failed = [f"the helper exited {r.returncode}: {r.stderr.strip()[-300:]}"]
    return failed


def _detach(pid: str, paths: list[str]) -> None:
    """``--detach PID PATH…``: join the mount namespace of PID, detach each PATH, print
    ``PATH: reason`` for each that fails (one that is not mounted any more is fine)."""
    try:
        fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY)
        _call("setns", fd, CLONE_NEWNS)
        os.chdir("/")
    except OSError as e:
        print(f"cannot enter the mount namespace of {pid}: {e}", flush=True)
        os._exit(1)
    for path in paths:
        try:
            _call("umount2", path.encode(), MNT_DETACH)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOENT):  # not a mount point (any more)
                print(f"{path}: {e}", flush=True)
    os._exit(0)


# ---------------------------------------------------------------------- the three processes

_libc = None


def _call(name: str, *args) -> None:
    global _libc
    if _libc is None:
        # the C library this Python already runs on (find_library would fork ldconfig,
        # which took PID 2 in the namespace and could pass for the init on the host)
        _libc = ctypes.CDLL(None, use_errno=True)
    if getattr(_libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def _say(message: str) -> None:
    os.write(2, f"gpusnap sandbox: {message}\n".encode(errors="replace"))


def _status_exit(status: int) -> None:
    """Leave this process the way ``status`` (from waitpid) says a child left."""
    if os.WIFSIGNALED(status):
        _die_by(os.WTERMSIG(status))
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1
    if code > 128 and code - 128 in signal.valid_signals():
        _die_by(code - 128)  # the init's way of saying "killed by signal N"
    os._exit(code)


def _die_by(signum: int) -> None:
    if signum not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # a signal that does not kill (SIGCHLD…): exit like a shell


def _relay(child: int, reap_others: bool) -> int:
    """Pass every stop signal on to ``child`` until it exits; its waitpid status.

    The signals are never handled, only kept blocked and taken with ``sigtimedwait``
    (as tini does): a blocked signal stays pending even for a namespace's init, which
    the kernel would otherwise drop while it has no handler, and there is no moment at
    which a handler runs before ``child`` is known. ``reap_others``: also reap any other
    process that ends (the init adopts detached jobs).
    """
    wanted = {*FORWARDED, signal.SIGCHLD}
    while True:
        info = signal.sigtimedwait(wanted, 5.0)
        if info is not None and info.si_signo != signal.SIGCHLD:
            try:
                os.kill(child, info.si_signo)
            except OSError:
                pass
        while True:  # SIGCHLDs coalesce: reap until nothing is left to reap
            try:
                pid, status = os.waitpid(-1 if reap_others else child, os.WNOHANG)
            except ChildProcessError:
                return 0
            if pid == 0:
                break
            if pid == child:
                return status


def _launcher(log: str, user: str | None, cmd: list[str]) -> None:
    try:
        _call("unshare", CLONE_NEWNS | CLONE_NEWPID)
        # a private copy: nothing mounted in here shows on the host, and back
        _call("mount", None, b"/", None, MS_REC | MS_PRIVATE, None)
    except OSError as e:
        _say(f"cannot make the server's namespaces ({e}); the Hub must run as root")
        os._exit(1)
    # Blocked from here on, in the init too (the mask survives fork and exec): each
    # process takes them with sigtimedwait (see _relay), so none is lost or dropped.
    signal.pthread_sigmask(signal.SIG_BLOCK, {*FORWARDED, signal.SIGCHLD})
    init = os.fork()
    if init == 0:
        try:
            _call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            args = [sys.executable, "-I", "-S", os.path.abspath(__file__), "--init", "--log", log]
            os.execv(sys.executable, args + (["--user", user] if user else []) + ["--", *cmd])
        except OSError as e:
            _say(f"cannot start the server's init: {e}")
        os._exit(1)
    _status_exit(_relay(init, reap_others=False))


def _init(log: str, user: str | None, cmd: list[str]) -> None:
    try:
        _call("mount", b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    except OSError as e:
        _say(f"cannot set up the server's namespace: {e}")
        os._exit(1)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.closerange(3, os.sysconf("SC_OPEN_MAX") if os.sysconf("SC_OPEN_MAX") > 0 else 1024)
    server = os.fork()
    if server == 0:
        _server(user, cmd)
    # every process left in the namespace is killed when its init exits
    _status_exit(_relay(server, reap_others=True))


def _server(user: str | None, cmd: list[str]) -> None:
    # a signal sent since the fork, pending, ends the server here
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {*FORWARDED, signal.SIGCHLD})
    try:
        os.setsid()
        if user is not None:
            import pwd

            pw = pwd.getpwnam(user)
            os.initgroups(pw.pw_name, pw.pw_gid)
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
        os.execvp(cmd[0], cmd)
    except (OSError, KeyError) as e:
        _say(f"cannot start {cmd[0]!r} as {user or 'this user'}: {e}")
    os._exit(127)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--detach"] and len(argv) > 2:
        _detach(argv[1], argv[2:])
    log, user, init = "", None, False
    while argv and argv[0] != "--":
        if argv[0] == "--init":
            init, argv = True, argv[1:]
            continue
        opt, value, argv = argv[0], argv[1] if len(argv) > 1 else "", argv[2:]
        if opt == "--log":
            log = value
        elif opt == "--user":
            user = value
        else:
            _say(f"unknown option {opt}")
            os._exit(2)
    cmd = argv[1:]
    if not log or not cmd:
        _say("usage: sandbox.py --log FILE [--user NAME] -- COMMAND [ARG…]")
        os._exit(2)
    (_init if init else _launcher)(log, user, cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
