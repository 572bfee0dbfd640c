"""``criu restore`` with inherited file descriptors, started inside a cgroup.

A container's restore hands CRIU open files of the placeholder it restores into: the
pod's network namespace (``extRootNetNS``) and the stdio pipes of the placeholder's
conmon (``pipe:[…]``), as ``--inherit-fd fd[N]:KEY``; the fds must be open in the
``criu`` process. :func:`~jupyterhub_gpusnap.checkpoint.criu.restore` starts CRIU with
no fds but stdio, so the agent starts it here with them, otherwise the same way: inside
the placeholder's cgroup, with ``--tcp-close --file-locks``, returning once CRIU logged
that the tree runs; ``criu`` stays the restored tree's parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from pathlib import Path

from ..checkpoint import criu as criu_tools
from ..checkpoint.base import CheckpointError, CheckpointRefused


def _enter(procs: str):
    """A ``preexec_fn`` moving the forked child into the cgroup of ``procs`` (raw write)."""

    def enter() -> None:
        fd = os.open(procs, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)

    return enter


def _finished(log: Path) -> bool:
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.path.getsize(log) - 4096))
            return b"Restore finished successfully" in f.read()
    except OSError:
        return False


async def restore_inheriting(
    directory: Path,
    pidfile: Path,
    *,
    criu: str,
    extra: list[str],
    inherit: list[tuple[str, str]],
    cgroup: Path,
    timeout: float,
) -> criu_tools.Restored:
    """Restore the images in ``directory`` with ``inherit`` (``(path, key)``: each path is
    opened and passed as ``--inherit-fd fd[N]:key``), started in ``cgroup``.

    Raises :class:`CheckpointError` with the log tail when CRIU fails or takes longer than
    ``timeout`` (then it is killed).
    """
    binary = criu_tools.find_criu(criu)
    if not binary:
        raise CheckpointRefused(f"CRIU not found: {criu_tools.INSTALL_HINT.format(min='4.2')}")
    procs = Path(cgroup) / "cgroup.procs"
    if not os.access(procs, os.W_OK):
        raise CheckpointError(
            f"cannot start criu restore in cgroup {cgroup}: {procs} is not writable; "
            "mount the cgroup v2 hierarchy read-write and run as root"
        )
    pidfile.unlink(missing_ok=True)
    log_name = time.strftime("restore-%Y%m%dT%H%M%SZ.log", time.gmtime())
    args = [binary, "restore", "-D", str(directory), "-o", log_name, "-v4"]
    args += ["--pidfile", str(pidfile), "--tcp-close", "--file-locks"]
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
        try:
            proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
                pass_fds=fds,
                preexec_fn=_enter(str(procs)),
            )
        except subprocess.SubprocessError as e:
            raise CheckpointError(f"cannot start criu restore in cgroup {cgroup}: {e}") from e
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    log = Path(directory) / log_name
    deadline = time.monotonic() + timeout
    while True:
        status = proc.poll()
        pid = criu_tools.read_pidfile(pidfile)
        if pid and status is None and _finished(log):
            return criu_tools.Restored(pid=pid, criu=proc, log=log)
        if status is not None:
            raise CheckpointError(
                f"criu restore from {directory} failed (exit {status}); log {log}:\n"
                f"{criu_tools.log_tail(log)}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise CheckpointError(
                f"criu restore from {directory} took longer than {timeout:g}s and was stopped; log {log}"
            )
        await asyncio.sleep(0.02)
