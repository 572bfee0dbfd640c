"""The agent's tornado handlers: bearer auth, JSON bodies, errors as ``{"error", "fix"}``.

Each handler is a thin shell over one :class:`~.app.AgentApp` method.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import TYPE_CHECKING

from tornado import web

from ..kube.errors import AgentError

if TYPE_CHECKING:
    from .app import AgentApp

POD_KEY = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-.a-z0-9]*[a-z0-9])?$")


class AgentHandler(web.RequestHandler):
    """Bearer auth, JSON bodies, and errors as ``{"error", "fix"}``."""

    @property
    def agent(self) -> AgentApp:
        return self.settings["agent"]

    async def prepare(self) -> None:
        header = self.request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        self.caller = await self.agent.authenticate(
            token.strip() if scheme.lower() == "bearer" else ""
        )

    def body(self) -> dict:
        try:
            data = json.loads(self.request.body or b"{}")
        except ValueError as e:
            raise AgentError(f"the body is not JSON: {e}", "send a JSON object", 400) from e
        if not isinstance(data, dict):
            raise AgentError("the body is not a JSON object", "send a JSON object", 400)
        return data

    def send(self, data: dict) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(data))

    def write_error(self, status_code: int, **kwargs) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, AgentError):
            data = exc.as_dict()
        elif isinstance(exc, web.HTTPError):
            data = {"error": exc.log_message or self._reason, "fix": ""}
        else:
            data = {
                "error": f"{type(exc).__name__}: {exc}" if exc else self._reason,
                "fix": "see the agent's log",
            }
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(data))

    def log_exception(self, typ, value, tb) -> None:
        if isinstance(value, AgentError):
            self.agent.log.warning("%s %s: %s", self.request.method, self.request.path, value)
        else:
            super().log_exception(typ, value, tb)

    def _handle_request_exception(self, e: BaseException) -> None:
        if isinstance(e, AgentError) and not self._finished:
            self.log_exception(type(e), e, e.__traceback__)
            self.send_error(e.code, exc_info=(type(e), e, e.__traceback__))
            return
        super()._handle_request_exception(e)


class HealthHandler(AgentHandler):
    async def get(self) -> None:
        driver = await asyncio.to_thread(self.agent.nvml.driver_version)
        self.send(
            {"ok": True, "node": self.agent.node_name, "criu": self.agent._criu, "driver": driver}
        )


class SignalsHandler(AgentHandler):
    async def get(self) -> None:
        keys = self.get_arguments("pod")
        bad = [k for k in keys if not POD_KEY.match(k)]
        if bad or not keys:
            raise AgentError(
                f"bad pod argument(s): {bad or '(none)'}",
                "pass ?pod=NAMESPACE/POD (repeatable)",
                400,
            )
        self.send(await self.agent.signals(keys))


class GpusHandler(AgentHandler):
    async def get(self) -> None:
        self.send(await self.agent.gpus())


class CheckpointHandler(AgentHandler):
    async def post(self) -> None:
        self.send(await self.agent.checkpoint(self.body()))


class RestoreHandler(AgentHandler):
    async def post(self) -> None:
        self.send(await self.agent.restore(self.body()))


class ParkHandler(AgentHandler):
    async def post(self) -> None:
        self.send(await self.agent.park(self.body(), resume=False))


class UnparkHandler(AgentHandler):
    async def post(self) -> None:
        self.send(await self.agent.park(self.body(), resume=True))


class DoctorHandler(AgentHandler):
    async def get(self) -> None:
        self.send(await self.agent.doctor())
