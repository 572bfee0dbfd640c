"""Run the real jupyterhub-gpusnap service next to a RealHub (as an external service).

The test starts and kills the service process itself, so it can restart it mid-window;
the Hub knows it as an external service with a fixed token and URL.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import sys
from pathlib import Path

from tornado.httpclient import AsyncHTTPClient, HTTPRequest

from jupyterhub_gpusnap.app import CUSTOM_SCOPES, REQUIRED_SCOPES

from .ports import free_port


class GpuSnapService:
    """The service as a real process, configured by a gpusnap_config.py text."""

    def __init__(self, root: Path, settings: str, scopes: list[str] | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.settings = settings
        self.scopes = sorted(REQUIRED_SCOPES) if scopes is None else scopes
        self.proc: asyncio.subprocess.Process | None = None
        self.log_file = self.root / "gpusnap.log"
        self.hub = None

    def hub_config(self) -> str:
        """Config text for the Hub: the service, its role and our custom scopes."""
        return f"""
c.JupyterHub.services.append({{
    "name": "gpusnap",
    "url": "http://127.0.0.1:{self.port}",
    "api_token": {self.token!r},
    "oauth_no_confirm": True,
    "oauth_client_allowed_scopes": ["custom:gpusnap:read", "custom:gpusnap:admin"],
}})
c.JupyterHub.custom_scopes = {CUSTOM_SCOPES!r}
c.JupyterHub.load_roles = [
    {{"name": "gpusnap", "services": ["gpusnap"], "scopes": {self.scopes!r}}},
    {{"name": "user", "scopes": ["self", "access:services!service=gpusnap"]}},
]
"""

    async def start(self, hub) -> None:
        self.hub = hub
        cfg = self.root / "gpusnap_config.py"
        cfg.write_text(
            "c = get_config()  # noqa\n"
            f"c.GpuSnap.db_url = 'sqlite:///{self.root / 'gpusnap.sqlite'}'\n"
            f"c.GpuSnap.proxy_url = {hub.url.rstrip('/')!r}\n" + self.settings
        )
        env = dict(os.environ)
        env.update(
            JUPYTERHUB_API_TOKEN=self.token,
            JUPYTERHUB_API_URL=hub.api_url,
            JUPYTERHUB_SERVICE_URL=f"http://127.0.0.1:{self.port}",
            JUPYTERHUB_SERVICE_PREFIX="/services/gpusnap/",
            JUPYTERHUB_SERVICE_NAME="gpusnap",
            JUPYTERHUB_CLIENT_ID="service-gpusnap",
            JUPYTERHUB_OAUTH_CALLBACK_URL="/services/gpusnap/oauth_callback",
            PYTHONUNBUFFERED="1",
        )
        log = open(self.log_file, "ab")
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "jupyterhub_gpusnap.app",
            "--config",
            str(cfg),
            "--debug",
            cwd=self.root,
            env=env,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        for _ in range(200):
            try:
                status, _ = await self.api("GET", "api/info")
                if status in (200, 403):
                    return
            except OSError:
                pass
            if self.proc.returncode is not None:
                raise AssertionError(f"service exited {self.proc.returncode}:\n{self.log_text()}")
            await asyncio.sleep(0.1)
        raise AssertionError(f"service did not answer:\n{self.log_text()}")

    async def kill(self) -> None:
        if self.proc and self.proc.returncode is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            await self.proc.wait()

    async def stop(self) -> None:
        if self.proc and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 20)
            except asyncio.TimeoutError:
                await self.kill()

    def log_text(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    async def api(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        token: str | None = None,
        direct: bool = False,
    ):
        """Call the service's API through the proxy (or directly); return (status, json)."""
        base = f"http://127.0.0.1:{self.port}" if direct else self.hub.url.rstrip("/")
        headers = {}
        tok = token if token is not None else (self.hub.admin_token if self.hub else None)
        if tok:
            headers["Authorization"] = f"token {tok}"
        req = HTTPRequest(
            f"{base}/services/gpusnap/{path}",
            method=method,
            headers=headers,
            body=None
            if body is None and method == "GET"
            else json.dumps(body or {})
            if not isinstance(body, bytes)
            else body,
            allow_nonstandard_methods=True,
            follow_redirects=False,
            request_timeout=20,
        )
        resp = await AsyncHTTPClient().fetch(req, raise_error=False)
        if resp.code == 599:
            raise OSError(str(resp.error))
        text = resp.body.decode("utf8", "replace") if resp.body else ""
        try:
            return resp.code, json.loads(text) if text else None
        except ValueError:
            return resp.code, text

    async def server_status(self, key: str) -> dict | None:
        status, data = await self.api("GET", f"api/servers/{key}")
        return data if status == 200 else None

    async def wait_for(self, predicate, timeout: float = 60, what: str = "condition"):
        """Poll an async predicate until it returns something truthy."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            value = await predicate()
            if value:
                return value
            await asyncio.sleep(0.3)
        # the log without its debug lines (the watcher's every reading), which would fill it
        told = "\n".join(
            line for line in self.log_text().splitlines() if not line.startswith("[D ")
        )
        raise AssertionError(
            f"timed out waiting for {what}\n--- service log (no debug lines):\n{told[-5000:]}"
        )


async def stop_recorded(service: GpuSnapService, key: str) -> bool:
    code, data = await service.api("GET", f"api/events?server={key}")
    assert code == 200, data
    return "stop" in [e["kind"] for e in data["events"]]
