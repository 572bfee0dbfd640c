"""The REST API (docs/rest-api.yml is its OpenAPI description)."""

from __future__ import annotations

import math
import time
from datetime import datetime

from tornado import web

from .. import __version__
from ..gpu.view import RoomRequestError
from ..model import State, server_key
from ..service import NotRunning, iso
from ..signals.jupyter import Report, ReportError
from .base import APIHandler

#: The latest ``until`` the API takes: the last second of the year 9999 (datetime's limit).
LATEST_UNTIL = 253402300799.0


def _number(value: object) -> float | None:
    """``value`` as a finite float, or None (not a number, a bool, too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)  # a 400-digit integer overflows here
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def parse_until(body: dict, now: float) -> float:
    """keep-running body: {"seconds": N} or {"until": ISO 8601 or epoch seconds}."""
    if "seconds" in body:
        seconds = _number(body["seconds"])
        if seconds is None or seconds <= 0 or seconds > LATEST_UNTIL:
            raise web.HTTPError(
                400,
                "'seconds' must be a positive number of seconds, at most a few years, e.g. {\"seconds\": 3600}",
            )
        return now + seconds
    if "until" in body:
        until = body["until"]
        if isinstance(until, str):
            try:
                stamp = datetime.fromisoformat(until.replace("Z", "+00:00"))
            except ValueError:
                stamp = None
            if stamp is not None:
                if stamp.tzinfo is None:
                    raise web.HTTPError(400, "'until' needs a time zone, e.g. 2026-11-22T18:00:00Z")
                until = stamp.timestamp()
        number = _number(until)
        if number is None:
            raise web.HTTPError(
                400,
                "'until' must be an ISO 8601 time such as 2026-11-22T18:00:00Z, or epoch seconds",
            )
        if number <= now:
            raise web.HTTPError(400, "'until' is in the past; choose a later time")
        if number > LATEST_UNTIL:
            raise web.HTTPError(400, "'until' is after the year 9999; choose an earlier time")
        return number
    raise web.HTTPError(400, 'Send {"seconds": N} or {"until": "<ISO 8601 time>"}')


class InfoHandler(APIHandler):
    async def get(self):
        model = self.require_user()
        app = self.gpusnap
        self.write_json(
            {
                "version": __version__,
                "user": model["name"],
                "admin": self.is_admin(model),
                "interval": app.interval,
                "states": [s.value for s in State],
            }
        )


class ServersHandler(APIHandler):
    async def get(self):
        model = self.require_user()
        service = self.service
        if self.can_read_all(model):
            statuses = service.all()
        else:
            statuses = [s for s in service.all() if s.user == model["name"]]
        state = self.get_argument("state", None)
        if state:
            if state not in State.__members__:
                raise web.HTTPError(
                    400, f"Unknown state {state!r}; one of {', '.join(State.__members__)}"
                )
            statuses = [s for s in statuses if str(s.state) == state]
        self.write_json({"servers": [service.model(s, with_events=False) for s in statuses]})


class ServerMixin:
    def find(self, user: str, name: str | None, write: bool = False):
        model = self.require_user()
        name = name or ""
        allowed = self.owns(model, user) or (
            self.is_admin(model) if write else self.can_read_all(model)
        )
        if not allowed and write and self.can_read_all(model):
            # a reader may see every server, so a 404 would mislead: say which scope acting needs
            raise web.HTTPError(
                403, f"Acting on {server_key(user, name)} needs the custom:gpusnap:admin scope"
            )
        if not allowed:
            # the same answer whether or not the server exists: no probing of other users
            raise web.HTTPError(404, f"No server {server_key(user, name)} that you may see")
        status = self.service.get(server_key(user, name))
        if status is None:
            raise web.HTTPError(404, f"No server {server_key(user, name)} is running or suspended")
        return model, status


class ServerHandler(ServerMixin, APIHandler):
    async def get(self, user, name=None):
        _, status = self.find(user, name)
        self.write_json(self.service.model(status))


class ServerActionHandler(ServerMixin, APIHandler):
    async def get(self, user, name=None, action=None):
        # GET api/servers/alice/keep is the status of alice's named server "keep", not an action
        if name is not None:
            raise web.HTTPError(
                404, "Actions are POST requests; GET api/servers/{user}/{name} for a status"
            )
        _, status = self.find(user, action)
        self.write_json(self.service.model(status))

    async def post(self, user, name=None, action=None):
        service = self.service
        body = self.json_body()
        if action == "jupyter":
            return self.jupyter_report(user, name or "", body)
        if action == "exempt":
            model, status = self.find(user, name, write=True)
            if not self.is_admin(model):
                raise web.HTTPError(403, "Exempting a server needs the custom:gpusnap:admin scope")
            exempt = body.get("exempt", True)
            if not isinstance(exempt, bool):
                raise web.HTTPError(400, "'exempt' must be true or false")
            status = service.exempt(status.key, exempt, by=model["name"])
            return self.write_json(service.model(status))
        model, status = self.find(user, name, write=True)
        if action == "keep":
            until = parse_until(body, time.time())
            try:
                status = service.keep(status.key, until)
            except ValueError as e:
                raise web.HTTPError(400, str(e)) from None
            return self.write_json(service.model(status))
        if action == "interaction":
            if not self.owns(model, user):
                raise web.HTTPError(403, "Only the server's owner reports their own interaction")
            try:
                service.interaction(status.key)
            except KeyError:
                raise web.HTTPError(409, f"{status.key} is {status.state}, not running") from None
            return self.write_json(service.model(status, with_events=False))
        if action == "suspend":
            try:
                status = service.suspend_now(status.key, by=model["name"])
            except NotRunning as e:
                raise web.HTTPError(409, str(e)) from None
            return self.write_json(service.model(status), status=202)
        raise web.HTTPError(404)

    def jupyter_report(self, user: str, name: str, body: dict) -> None:
        """A server's own extension reports its kernels and terminals (the Jupyter signal)."""
        model = self.require_user()
        key = server_key(user, name)
        if not self.is_server_token(model, user, name):
            raise web.HTTPError(
                403,
                f"Only {key}'s own server token (its JUPYTERHUB_API_TOKEN) reports its kernels",
            )
        try:
            report = Report.from_body(body, time.time())
        except ReportError as e:
            raise web.HTTPError(400, str(e)) from None
        source = self.gpusnap.jupyter_signal
        if source is not None:
            source.record(key, report)
        status = self.service.get(key)
        self.write_json(
            {
                "server": key,
                "recorded": source is not None,
                "state": str(status.state) if status else None,
            }
        )


class EventsHandler(APIHandler):
    async def get(self):
        model = self.require_user()
        key = self.get_argument("server", None)
        try:
            limit = int(self.get_argument("limit", "50"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 500:
            raise web.HTTPError(400, "'limit' must be a whole number from 1 to 500, e.g. ?limit=50")
        if key is None:
            if not self.can_read_all(model):
                raise web.HTTPError(
                    403,
                    "Listing every server's events needs custom:gpusnap:read; pass ?server=user/name",
                )
        elif not (self.can_read_all(model) or self.owns(model, key.partition("/")[0])):
            raise web.HTTPError(404, f"No server {key} that you may see")
        events = self.service.events(key, limit=limit)
        self.write_json({"events": [{**e, "time": iso(e["time"])} for e in events]})


class MakeRoomHandler(APIHandler):
    """Park idle servers until a requested amount of GPU memory is free (admins)."""

    async def post(self):
        model = self.require_user()
        if not self.is_admin(model):
            raise web.HTTPError(403, "Making room needs the custom:gpusnap:admin scope")
        body = self.json_body()
        nbytes = body.get("bytes")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise web.HTTPError(
                400, "'bytes' must be a positive integer, e.g. {\"bytes\": 17179869184} for 16 GiB"
            )
        gpu = body.get("gpu")
        if gpu is not None and (isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0):
            raise web.HTTPError(
                400, "'gpu' must be a GPU index (0, 1, …) as nvidia-smi numbers them, or left out"
            )
        node = body.get("node")
        if node is not None and (not isinstance(node, str) or not node):
            raise web.HTTPError(
                400, "'node' must be a Kubernetes node name (kubectl get nodes), or left out"
            )
        try:
            result = await self.service.make_room(nbytes, gpu=gpu, node=node)
        except RoomRequestError as e:
            raise web.HTTPError(400, str(e)) from None
        self.write_json(result)
