"""Start the demo: ``python -m jupyterhub_gpusnap.demo [--dir DIR] [--port 8000]`` (as root).

It writes a JupyterHub config into DIR, starts a local SMTP sink that prints every email and
saves it under DIR/mail/, then runs JupyterHub in the foreground with:

- the ``SnapSimpleLocalProcessSpawner`` (every user runs as root in DIR/home/<user>),
- the gpusnap service as a managed service with short windows (idle 2 min, warning 1 min before),
- the local CRIU backend writing checkpoints to DIR/checkpoints.

Ctrl-C (or SIGTERM) shuts the Hub down cleanly: the Hub stops the gpusnap service, every user's
server (JupyterHub's ``cleanup_servers``, on in the demo) and configurable-http-proxy; after
SHUTDOWN_TIMEOUT seconds, or on a second Ctrl-C, whatever is left is killed.
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

HERE = Path(__file__).parent
#: seconds the Hub gets after Ctrl-C: JupyterHub gives the service and each server up to 30 s after
#: SIGINT and 30 s after SIGTERM (interrupt_timeout, term_timeout), then stops the proxy
SHUTDOWN_TIMEOUT = 150
#: the banner's reminder comes back after this many lines of log, once the log is quiet
REMIND_AFTER_LINES = 40


def write_config(root: Path, port: int, smtp_port: int, idle: int) -> Path:
    cfg = (HERE / "jupyterhub_config.py").read_text()
    cfg = cfg.replace("@ROOT@", str(root)).replace("@PORT@", str(port))
    cfg = cfg.replace("@SMTP_PORT@", str(smtp_port)).replace("@IDLE@", str(idle))
    cfg = cfg.replace("@PYTHON@", sys.executable)
    path = root / "jupyterhub_config.py"
    path.write_text(cfg)
    return path


def banner(url: str, root: Path, idle: int) -> str:
    return textwrap.dedent(f"""
        ──────────────────────────────────────────────────────────────────────────────
         jupyterhub-gpusnap demo
         Open {url}/ and log in as any user name with the password "demo".
         1. Start a notebook, run   x = 42   in a cell, and leave it alone.
         2. After {idle // 2} s idle you get a warning email (printed here, saved in {root}/mail).
         3. After {idle} s idle the server is checkpointed with CRIU, verified and stopped.
         4. Come back: the open Lab tab says the server is suspended and offers Restore
            (or open {url}/hub/home): same kernel, x is still 42.
         Service pages: {url}/services/gpusnap/  ·  checkpoints: {root}/checkpoints
         Every server, as admin (password "demo"): {url}/services/gpusnap/admin
         Ctrl-C stops the demo; the Hub stops every running server (kernels that were not
         suspended are lost), suspended servers keep their checkpoints.
        ──────────────────────────────────────────────────────────────────────────────
        """)


def reminder(url: str) -> str:
    return (
        f'── gpusnap demo: {url}/ (any name, password "demo") · '
        f"service {url}/services/gpusnap/ · Ctrl-C stops ──\n"
    )


def _pump(stream, lines: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        lines.put(line)


def _is_proxy(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"configurable-http-proxy" in cmdline


def stop_leftover_proxy(pid_file: Path) -> None:
    """Stop the Hub's configurable-http-proxy if the Hub could not (it was killed)."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return
    for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGKILL):
        if not _is_proxy(pid):
            break
        print(f"stopping configurable-http-proxy (pid {pid}) left by the Hub", flush=True)
        os.kill(pid, sig)
        for _ in range(20):
            if not _is_proxy(pid):
                break
            time.sleep(0.1)
    pid_file.unlink(missing_ok=True)


def run_hub(config: Path, root: Path, text: str) -> int:
    """Run the Hub until it exits; Ctrl-C/SIGTERM/SIGHUP ask it to shut down, a second one kills it."""
    # its own session: a terminal's Ctrl-C reaches only us, and we decide how the Hub stops
    hub = subprocess.Popen(
        [sys.executable, "-m", "jupyterhub", "-f", str(config)],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(hub.stdout, lines), daemon=True).start()
    asked: list[float] = []

    def ask_to_stop(signum, frame):
        if not asked:
            print(
                f"\nstopping the demo: the Hub shuts down (up to {SHUTDOWN_TIMEOUT} s; "
                "Ctrl-C again to kill it now)",
                flush=True,
            )
            asked.append(time.monotonic())
            hub.send_signal(signal.SIGTERM)
        else:
            asked.append(0.0)  # a second request: no more waiting

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, ask_to_stop)
    since_banner = 0
    while True:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            line = None
        if line is not None:
            sys.stdout.write(line)
            sys.stdout.flush()
            since_banner += 1
            continue
        if hub.poll() is not None:
            break
        if asked and (len(asked) > 1 or time.monotonic() - asked[0] > SHUTDOWN_TIMEOUT):
            print("the Hub did not stop in time: killing it", flush=True)
            hub.kill()
            hub.wait()
            break
        if not asked and since_banner >= REMIND_AFTER_LINES:
            # the log has been quiet for a second: the way in comes back into view
            sys.stdout.write(text)
            sys.stdout.flush()
            since_banner = 0
    while not lines.empty():
        sys.stdout.write(lines.get())
    stop_leftover_proxy(root / "jupyterhub-proxy.pid")
    return 0 if asked else hub.returncode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jupyterhub_gpusnap.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--dir", default="demo-data", help="where the demo keeps its files (default ./demo-data)"
    )
    p.add_argument("--port", type=int, default=8000, help="the hub's port (default 8000)")
    p.add_argument(
        "--smtp-port", type=int, default=8025, help="the SMTP sink's port (default 8025)"
    )
    p.add_argument(
        "--idle", type=int, default=120, help="seconds of idleness before suspension (default 120)"
    )
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print(
            "The demo checkpoints processes with CRIU, which needs root: run .ci/demo as root",
            file=sys.stderr,
        )
        return 1
    if not shutil.which("configurable-http-proxy"):
        print("configurable-http-proxy is missing: run .ci/setup first", file=sys.stderr)
        return 1
    root = Path(args.dir).resolve()
    for sub in ("home", "checkpoints", "mail"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "checkpoints", 0o700)
    config = write_config(root, args.port, args.smtp_port, args.idle)
    sink = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterhub_gpusnap.demo.smtp_sink",
            "--port",
            str(args.smtp_port),
            "--dir",
            str(root / "mail"),
        ],
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{args.port}"
    text = banner(url, root, args.idle)
    print(text, flush=True)
    try:
        return run_hub(config, root, reminder(url))
    finally:
        sink.terminate()
        try:
            sink.wait(10)
        except subprocess.TimeoutExpired:
            sink.kill()
        print("demo stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
