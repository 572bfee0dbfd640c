"""The extension's API handlers: the Lab panel's only way to the gpusnap service.

They are ordinary authenticated jupyter-server API handlers, except that they never count as
activity: the panel polls every few seconds, and a poll that moved the server's last_activity
would keep an idle server alive forever.
"""

from __future__ import annotations

import json
import os
from urllib.parse import quote

from jupyter_server.base.handlers import APIHandler
from tornado import web
from tornado.web import authenticated

from .client import GpuSnapClient, ServiceError


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number (RFC 8259); send a finite number")


class GpuSnapHandler(APIHandler):
    """Base: authenticated as any jupyter-server API call, invisible to activity tracking."""

    # jupyter-server records API activity in settings["api_last_activity"] in finish()
    # unless _track_activity is False; the override below makes this explicit.
    _track_activity = False

    def update_api_activity(self) -> None:
        """Polling the gpusnap status is not the user working: record nothing."""

    @property
    def client(self) -> GpuSnapClient:
        return self.settings["gpusnap_client"]

    async def relay(
        self, method: str, action: str = "", body: dict | None = None, local: dict | None = None
    ) -> None:
        """Answer with the service's answer for this server (``local`` added to it, or to
        the error, so the panel has it even when the service cannot be reached)."""
        try:
            status, data = await self.client.call(method, action, body)
            if isinstance(data, dict):
                self.settings["gpusnap_on_status"](data)
        except ServiceError as e:
            self.set_status(e.status)
            error = {"message": e.message, "server": self.client.server_key}
            self.finish(json.dumps({**error, **(local or {})}))
            return
        if local and isinstance(data, dict):
            data.update(local)
        self.set_status(status)
        self.finish(json.dumps(data))

    def autounpark_state(self) -> dict:
        """This server's automatic unpark, as :meth:`AutoUnpark.state` describes it."""
        watcher = self.settings.get("gpusnap_autounpark")
        if watcher is None:
            return {
                "watching": False,
                "resuming": False,
                "resuming_since": None,
                "resuming_kernels": [],
                "last_unpark": None,
            }
        return watcher.state()

    def body(self) -> dict:
        if not self.request.body:
            return {}
        try:
            data = json.loads(self.request.body, parse_constant=_no_constant)
        except (ValueError, RecursionError) as e:
            raise web.HTTPError(400, f"Request body is not JSON: {str(e)[:200]}") from None
        if not isinstance(data, dict):
            raise web.HTTPError(400, "Request body must be a JSON object")
        return data


class StatusHandler(GpuSnapHandler):
    @authenticated
    async def get(self) -> None:
        """This server's gpusnap status (the service's status model, with events), plus
        ``autounpark``: whether a parked kernel's GPU memory is being brought back now."""
        await self.relay("GET", local={"autounpark": self.autounpark_state()})


class AutoUnparkHandler(GpuSnapHandler):
    @authenticated
    def get(self) -> None:
        """Only the automatic unpark's state, answered here without asking the service: the
        panel polls it every second while the server is parked, to show "resuming…"."""
        self.finish(json.dumps(self.autounpark_state()))


class KeepHandler(GpuSnapHandler):
    @authenticated
    async def post(self) -> None:
        """Keep running: {"seconds": N} or {"until": ISO}; the service clamps it to the admin's maximum."""
        await self.relay("POST", "keep", self.body())


class SuspendHandler(GpuSnapHandler):
    @authenticated
    async def post(self) -> None:
        """Suspend this server now (checkpoint, then stop), freeing its GPU."""
        await self.relay("POST", "suspend", {})


class InteractionHandler(GpuSnapHandler):
    @authenticated
    async def post(self) -> None:
        """The user pressed a key, clicked or scrolled in a visible Lab tab (the Lab extension
        sends this at most twice a minute): tell the service, which keeps a server in use
        from being suspended (its own signal and window in the policy)."""
        await self.relay("POST", "interaction", {})


class ServiceHandler(GpuSnapHandler):
    @authenticated
    def get(self) -> None:
        """Where the tab reaches the service directly, and with which token, once this server
        is suspended and these handlers are gone with it: the Lab tab then still reads the
        truth ("suspended at T, your kernels are saved") from the service.

        The token is this server's own (JUPYTERHUB_API_TOKEN), and handing it to the browser
        stays safe with the scopes it carries (hubconfig.server_token_scopes):
        ``access:servers!server=<this server>`` (this server, which the browser already
        uses), ``users:activity!user=<owner>`` (post the owner's activity to the Hub) and
        ``access:services!service=gpusnap``, with which the service lets it act as the
        owner on the owner's own servers only (status, keep running, suspend, interaction,
        this server's Jupyter report). Each is something the user can already do, and every
        kernel and terminal of this server has the token in its environment; the Hub grants
        a server's token nothing its user lacks. JupyterHub keeps it across a suspension
        (the spawner resumes), so the tab can still ask the service once the server is gone.
        """
        client = self.client
        if client.server_key is None:
            raise web.HTTPError(
                404, "This server is not running under JupyterHub: no gpusnap service"
            )
        base = os.environ.get("JUPYTERHUB_BASE_URL", "/")
        base = base if base.endswith("/") else base + "/"
        url = f"{base}services/{quote(client.service_name, safe='')}/{client.server_path()}"
        self.finish(
            json.dumps({"url": url, "token": client.api_token, "server": client.server_key})
        )


class BackHandler(GpuSnapHandler):
    @authenticated
    def get(self) -> None:
        """Where a restore started from a Lab tab lands (the spawn's ``next``): a page that
        says the server is back, loaded in the tab's hidden frame, not a second JupyterLab."""
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.finish("<!doctype html><title>Restored</title><p>Your server is back.</p>")


def handlers(base_url: str) -> list[tuple[str, type]]:
    """Routes under the server's base_url."""
    base = base_url if base_url.endswith("/") else base_url + "/"
    return [
        (base + "gpusnap/status", StatusHandler),
        (base + "gpusnap/autounpark", AutoUnparkHandler),
        (base + "gpusnap/keep", KeepHandler),
        (base + "gpusnap/suspend", SuspendHandler),
        (base + "gpusnap/interaction", InteractionHandler),
        (base + "gpusnap/service", ServiceHandler),
        (base + "gpusnap/back", BackHandler),
    ]
