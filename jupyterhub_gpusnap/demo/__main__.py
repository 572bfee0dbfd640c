"""Start the demo: ``python -m jupyterhub_gpusnap.demo [--dir DIR] [--port 8000]`` (as root).

It writes a JupyterHub config into DIR, starts a local SMTP sink that prints every email and
saves it under DIR/mail/, then runs JupyterHub in the foreground with:

- the ``SnapSimpleLocalProcessSpawner`` (every user runs as root in DIR/home/<user>),
- the gpusnap service as a managed service with short windows (idle 2 min, warning 1 min before),
- the local CRIU backend writing checkpoints to DIR/checkpoints.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).parent


def write_config(root: Path, port: int, smtp_port: int, idle: int) -> Path:
    cfg = (HERE / "jupyterhub_config.py").read_text()
    cfg = cfg.replace("@ROOT@", str(root)).replace("@PORT@", str(port))
    cfg = cfg.replace("@SMTP_PORT@", str(smtp_port)).replace("@IDLE@", str(idle))
    cfg = cfg.replace("@PYTHON@", sys.executable)
    path = root / "jupyterhub_config.py"
    path.write_text(cfg)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jupyterhub_gpusnap.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="demo-data", help="where the demo keeps its files (default ./demo-data)")
    p.add_argument("--port", type=int, default=8000, help="the hub's port (default 8000)")
    p.add_argument("--smtp-port", type=int, default=8025, help="the SMTP sink's port (default 8025)")
    p.add_argument("--idle", type=int, default=120, help="seconds of idleness before suspension (default 120)")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("The demo checkpoints processes with CRIU, which needs root: sudo .ci/demo", file=sys.stderr)
        return 1
    if not shutil.which("configurable-http-proxy"):
        print("configurable-http-proxy is missing: run .ci/setup first", file=sys.stderr)
        return 1
    root = Path(args.dir).resolve()
    for sub in ("home", "checkpoints", "mail"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "checkpoints", 0o700)
    config = write_config(root, args.port, args.smtp_port, args.idle)
    sink = subprocess.Popen([sys.executable, "-m", "jupyterhub_gpusnap.demo.smtp_sink",
                             "--port", str(args.smtp_port), "--dir", str(root / "mail")])
    url = f"http://127.0.0.1:{args.port}"
    print(textwrap.dedent(f"""
        ──────────────────────────────────────────────────────────────────────────────
         jupyterhub-gpusnap demo
         Open {url}/ and log in as any user name with the password "demo".
         1. Start a notebook, run   x = 42   in a cell, and leave it alone.
         2. After {args.idle // 2} s idle you get a warning email (printed here, saved in {root}/mail).
         3. After {args.idle} s idle the server is checkpointed with CRIU, verified and stopped.
         4. Open {url}/hub/home again: the server is restored, same kernel, x is still 42.
         Service pages: {url}/services/gpusnap/  ·  checkpoints: {root}/checkpoints
        ──────────────────────────────────────────────────────────────────────────────
        """))
    try:
        return subprocess.call([sys.executable, "-m", "jupyterhub", "-f", str(config)], cwd=root)
    except KeyboardInterrupt:
        return 0
    finally:
        sink.terminate()


if __name__ == "__main__":
    sys.exit(main())
