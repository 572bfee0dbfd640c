"""A plain jupyter server (no hub) with the auto-unpark extension, as its own process."""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys

from tests.helpers.realhub import free_port


class JupyterServer:
    def __init__(self, tmp_path):
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}/"
        self.log = open(tmp_path / "server.log", "w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyter_server",
                "--allow-root",
                "--no-browser",
                f"--ServerApp.port={self.port}",
                f"--IdentityProvider.token={self.token}",
                "--ServerApp.jpserver_extensions=jupyterhub_gpusnap.gpu.autounpark=True",
                f"--ServerApp.root_dir={tmp_path}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )

    async def wait(self):
        from tornado.httpclient import AsyncHTTPClient

        for _ in range(300):
            try:
                await AsyncHTTPClient().fetch(f"{self.base}api/status?token={self.token}")
                return
            except Exception:
                await asyncio.sleep(0.1)
        raise AssertionError("jupyter server did not start")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)
