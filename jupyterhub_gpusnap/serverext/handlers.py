"""The extension's API handlers: the Lab panel's only way to the gpusnap service.

They are ordinary authenticated jupyter-server API handlers, except that they never count as
activity: the panel polls every few seconds, and a poll that moved the server's last_activity
would keep an idle server alive forever.
"""

from __future__ import annotations

import json

from jupyter_server.base.handlers import APIHandler
from tornado import web
from tornado.web import authenticated

from .client import GpuSnapClient, ServiceError


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

    async def relay(self, method: str, action: str = "", body: dict | None = None) -> None:
        try:
            status, data = await self.client.call(method, action, body)
        except ServiceError as e:
            self.set_status(e.status)
            self.finish(json.dumps({"message": e.message, "server": self.client.server_key}))
            return
        self.set_status(status)
        self.finish(json.dumps(data))

    def body(self) -> dict:
        if not self.request.body:
            return {}
        try:
            data = json.loads(self.request.body)
        except ValueError as e:
            raise web.HTTPError(400, f"Request body is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise web.HTTPError(400, "Request body must be a JSON object")
        return data


class StatusHandler(GpuSnapHandler):
    @authenticated
    async def get(self) -> None:
        """This server's gpusnap status (the service's status model, with events)."""
        await self.relay("GET")


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


def handlers(base_url: str) -> list[tuple[str, type]]:
    """Routes under the server's base_url."""
    base = base_url if base_url.endswith("/") else base_url + "/"
    return [
        (base + "gpusnap/status", StatusHandler),
        (base + "gpusnap/keep", KeepHandler),
        (base + "gpusnap/suspend", SuspendHandler),
    ]
