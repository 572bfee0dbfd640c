"""The guard of a lazy restore: holds the userfaultfds, kills the tree if the service dies.

When the last holder of a userfaultfd closes it, the kernel gives threads that fault on
the memory it covered *zero-filled pages* instead of theirs. During a lazy restore the
holder is ``criu lazy-pages``, which exits as soon as its page server (in the service)
goes away or fails. So this small process (``python -I -S uffd_guard.py DAEMON_PID
STAGING``, the standard library only, its own session) takes duplicates of the daemon's
userfaultfds (``pidfd_getfd``; rescanned every 20 ms for those that forks add) and keeps
them while the service tells it nothing:

- the service writes ``release`` on the guard's stdin once every page is in, or once it
  has killed a tree that cannot be finished: the guard closes the duplicates and exits 0;
- the service's end of the pipe closes without that (the service died): every process
  under the ``criu restore`` working in STAGING is killed with SIGKILL, then the guard
  lets go and exits 3.

Either way no process runs on with zero pages in place of its memory.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time

SYS_PIDFD_GETFD = 438  # the same number on every architecture (asm-generic)
SYS_KCMP = {"x86_64": 312, "aarch64": 272, "ppc64le": 354, "s390x": 343}.get(os.uname().machine)
KCMP_FILE = 0
UFFD = "anon_inode:[userfaultfd]"
POLL = 0.02


class UffdHold:
    """Duplicates of process ``pid``'s userfaultfds (:meth:`grab` takes new ones)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.fds: dict[tuple[int, str], int] = {}
        self.libc = ctypes.CDLL(None, use_errno=True)
        try:
            self.pidfd = os.pidfd_open(pid)
        except OSError:
            self.pidfd = None

    def grab(self) -> int:
        """Take duplicates of the daemon's new userfaultfds; let go of those it closed.

        The daemon closes a process's userfaultfd when that process exits (a fork that
        ended). Our duplicate must go too: it would keep the closed file registered in
        the daemon's epoll set, which then reports it forever and the daemon spins
        (``excess message in queue``), starving the transfer. Only a *live* daemon closing
        some of its userfaultfds is followed: a daemon that dies drops its whole fd table
        at once (none listed), and then every duplicate is kept."""
        if self.pidfd is None:
            return len(self.fds)
        try:
            entries = os.listdir(f"/proc/{self.pid}/fd")
        except OSError:
            return len(self.fds)
        current: dict[int, str] = {}
        for entry in entries:
            try:
                if os.readlink(f"/proc/{self.pid}/fd/{entry}") != UFFD:
                    continue
                with open(f"/proc/{self.pid}/fdinfo/{entry}") as f:
                    ino = next((ln.split()[1] for ln in f if ln.startswith("ino:")), "")
            except (OSError, IndexError):
                continue
            current[int(entry)] = ino
        if current:
            for key, fd in list(self.fds.items()):
                if current.get(key[0]) != key[1] or not self._same(fd, key[0]):
                    os.close(fd)  # closed by the daemon (its process ended), or reused
                    del self.fds[key]
        for n, ino in current.items():
            if (n, ino) not in self.fds:
                fd = self.libc.syscall(SYS_PIDFD_GETFD, self.pidfd, n, 0)
                if fd >= 0:
                    self.fds[(n, ino)] = fd
        return len(self.fds)

    def _same(self, ours: int, theirs: int) -> bool:
        """Whether the daemon's fd ``theirs`` is still the file we hold as ``ours``
        (kcmp); True where that cannot be asked."""
        if SYS_KCMP is None:
            return True
        got = self.libc.syscall(SYS_KCMP, os.getpid(), self.pid, KCMP_FILE, ours, theirs)
        return got == 0 or got < 0

    def release(self) -> None:
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def _restores(staging: str) -> list[int]:
    """``criu restore`` processes working in ``staging``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"restore" in argv and staging.encode() in argv:
            out.append(int(entry))
    return out


def kill_under(staging: str) -> None:
    """SIGKILL every process under the ``criu restore`` in ``staging``, until none is left."""
    for _ in range(100):
        kids = _children()
        todo = list(_restores(staging))
        victims = []
        while todo:
            for kid in kids.get(todo.pop(), []):
                victims.append(kid)
                todo.append(kid)
        if not victims:
            return
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)


def main(argv: list[str]) -> int:
    daemon, staging = int(argv[0]), argv[1]
    hold = UffdHold(daemon)
    try:
        while True:
            hold.grab()
            ready, _, _ = select.select([0], [], [], POLL)
            if not ready:
                continue
            data = os.read(0, 64)
            if data.startswith(b"release"):
                return 0
            if not data:  # the service is gone
                kill_under(staging)
                return 3
    finally:
        hold.release()


# ---------------------------------------------------------------------- used by lazy.py
def start(daemon_pid: int, staging: str) -> subprocess.Popen:
    """Start the guard of the lazy-pages daemon ``daemon_pid`` working in ``staging``."""
    return subprocess.Popen(
        [sys.executable, "-I", "-S", os.path.abspath(__file__), str(daemon_pid), staging],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def release(guard: subprocess.Popen, timeout: float = 10) -> int | None:
    """Tell the guard to let go (every page is in, or the tree is dead); its exit status."""
    try:
        guard.stdin.write(b"release\n")
        guard.stdin.close()
    except (OSError, ValueError):
        pass
    try:
        return guard.wait(timeout)
    except subprocess.TimeoutExpired:
        guard.kill()
        return guard.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
