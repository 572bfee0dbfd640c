"""A real Hub whose servers the local backend suspends and restores, as the service does.

``snap_config`` is the Hub's config (the restoring spawner, the checkpoints' folder),
``settings`` the service's (with email through a real SMTP server); ``suspend`` is what
the service does (checkpoint, verified, then stop through the Hub API); ``ProgressReader``
follows a spawn's progress stream.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tornado.httpclient import AsyncHTTPClient, HTTPRequest

from jupyterhub_gpusnap.checkpoint.local import LocalBackend
from jupyterhub_gpusnap.model import Server
from tests.helpers.smtp_server import SmtpServer

TEMPLATES = Path(__file__).parent.parent.parent / "jupyterhub_gpusnap" / "templates" / "hub"


def snap_config(ckpt: Path, extra: str = "") -> str:
    return f"""
c.JupyterHub.spawner_class = "jupyterhub_gpusnap.spawner.SnapSimpleLocalProcessSpawner"
c.LocalBackend.checkpoint_dir = {str(ckpt)!r}
c.LocalBackend.min_free_bytes = 0
c.SnapSimpleLocalProcessSpawner.restore_timeout = 60
c.JupyterHub.template_paths = [{str(TEMPLATES)!r}]
# these tests need the Jupyter server API only: skip loading JupyterLab (faster starts)
c.Spawner.args = ["--allow-root"] + [
    f"--ServerApp.jpserver_extensions={{ext}}=False"
    for ext in ("jupyterlab", "jupyter_lsp", "notebook_shim")
]
c.Spawner.default_url = "/api/status"
{extra}
"""


def service_backend(ckpt: Path, **kw) -> LocalBackend:
    """The backend as the service configures it (same checkpoint_dir as the Hub)."""
    return LocalBackend(checkpoint_dir=str(ckpt), min_free_bytes=0, **kw)


async def suspend(hub, backend: LocalBackend, user: str, name: str = ""):
    """What the service does: checkpoint (verified, processes ended), then stop via the API."""
    model = await hub.get_server(user, name)
    assert model and model["ready"] and model["state"]["pid"]
    info = await backend.checkpoint(Server(user=user, name=name, state=model["state"]))
    assert info.status == "verified"
    await hub.stop_server(user, name)
    assert await hub.get_server(user, name) is None
    return info


class ProgressReader:
    """Reads the spawn progress stream (server-sent events) of a server while it spawns."""

    def __init__(self, hub, user: str):
        self.events: list[dict] = []
        self._buf = b""
        req = HTTPRequest(
            f"{hub.api_url}/users/{user}/server/progress",
            headers={"Authorization": f"token {hub.admin_token}"},
            streaming_callback=self._chunk,
            request_timeout=120,
        )
        self.done = asyncio.ensure_future(AsyncHTTPClient().fetch(req, raise_error=False))

    def _chunk(self, data: bytes) -> None:
        self._buf += data
        while b"\n\n" in self._buf:
            block, self._buf = self._buf.split(b"\n\n", 1)
            for line in block.decode().splitlines():
                if line.startswith("data:"):
                    self.events.append(json.loads(line[5:]))

    def messages(self) -> str:
        return "\n".join(e.get("message", "") for e in self.events)


def settings(ckpt: Path, smtp: SmtpServer) -> str:
    return f"""
c.GpuSnap.interval = 1
c.GpuSnap.idle_window = 8
c.GpuSnap.warn_before = 3
c.GpuSnap.min_running = 0
c.LocalBackend.checkpoint_dir = {str(ckpt)!r}
c.LocalBackend.min_free_bytes = 0
c.GpuSnap.email = True
c.Mailer.smtp_host = "127.0.0.1"
c.Mailer.smtp_port = {smtp.port}
c.Mailer.smtp_security = "starttls"
c.Mailer.smtp_username = {smtp.username!r}
c.Mailer.smtp_password = {smtp.password!r}
c.Mailer.tls_ca_file = {str(smtp.ca_file)!r}
c.Mailer.from_address = "gpusnap@example.org"
c.Notifier.address_from = "template"
c.Notifier.address_template = "{{username}}@example.org"
c.Notifier.send_restored = True
"""
