"""The JupyterHub REST API, as the service uses it: list running servers, stop one, read a user."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from datetime import datetime
from urllib.parse import quote, urlencode

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from traitlets import Integer, Unicode
from traitlets.config import LoggingConfigurable

from .model import Server

_FROMISO_Z = sys.version_info >= (3, 11)  # fromisoformat reads a 'Z' suffix itself


def parse_time(value: str | None) -> datetime | None:
    """Parse the Hub's ISO 8601 timestamps (always UTC, 'Z' suffix)."""
    if not value:
        return None
    if _FROMISO_Z:
        return datetime.fromisoformat(value)
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


class HubError(Exception):
    """A Hub API request failed; the message says which and why."""

    def __init__(self, message: str, code: int = 0):
        super().__init__(message)
        self.code = code


def servers_of(user: dict) -> list[Server]:
    """The ready servers of one Hub user model (``GET /users`` item)."""
    groups = list(user.get("groups") or [])
    out = []
    for name, s in (user.get("servers") or {}).items():
        if not s.get("ready"):
            continue
        options = s.get("user_options") or {}
        out.append(
            Server(
                user=user["name"],
                name=name,
                url=s.get("url") or "",
                started=parse_time(s.get("started")),
                last_activity=parse_time(s.get("last_activity")),
                state=s.get("state") or {},
                groups=groups,
                profile=str(options.get("profile") or ""),
                ready=True,
                pending=s.get("pending"),
                admin=bool(user.get("admin")),
            )
        )
    return out


class HubClient(LoggingConfigurable):
    """A small async client for the Hub REST API with the service's token."""

    api_url = Unicode(
        help="The Hub API URL, e.g. http://127.0.0.1:8081/hub/api. "
        "Set from JUPYTERHUB_API_URL when the Hub manages the service.",
    ).tag(config=True)

    api_token = Unicode(
        help="The service's Hub API token. Set from JUPYTERHUB_API_TOKEN when the Hub manages the service.",
    ).tag(config=True)

    page_size = Integer(
        200,
        help="Users per page when listing servers (GET /users?state=ready&limit=N). "
        "Larger pages mean fewer requests on hubs with thousands of users; "
        "the Hub caps it at its own api_page_max_limit.",
    ).tag(config=True)

    request_timeout = Integer(
        60,
        help="Seconds a single Hub API request may take (listing thousands of users can be slow).",
    ).tag(config=True)

    concurrency = Integer(
        10,
        help="Hub API requests in flight at once, so a busy tick never floods the Hub.",
    ).tag(config=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._semaphore = asyncio.Semaphore(self.concurrency)
        self.requests = 0  # counted, for the scale benchmark and /metrics

    async def request(
        self, method: str, path: str, body: dict | None = None, **params
    ) -> dict | list | None:
        """One Hub API request; JSON in and out. Raises HubError with the Hub's message."""
        url = self.api_url.rstrip("/") + path
        if params:
            url += "?" + urlencode({k: v for k, v in params.items() if v is not None})
        req = HTTPRequest(
            url,
            method=method,
            headers={
                "Authorization": f"token {self.api_token}",
                "Accept": "application/jupyterhub-pagination+json",
                "Content-Type": "application/json",
            },
            body=json.dumps(body)
            if body is not None
            else (b"" if method in ("POST", "PUT", "PATCH") else None),
            request_timeout=self.request_timeout,
            allow_nonstandard_methods=True,
        )
        async with self._semaphore:
            self.requests += 1
            try:
                resp = await AsyncHTTPClient().fetch(req)
            except HTTPClientError as e:
                message = ""
                if e.response is not None and e.response.body:
                    try:
                        message = json.loads(e.response.body).get("message", "")
                    except (ValueError, AttributeError):
                        message = e.response.body[:200].decode("utf8", "replace")
                hint = ""
                if e.code == 403:
                    hint = " (the service's role lacks a scope: see docs/install.md for the load_roles entry)"
                raise HubError(f"{method} {path}: {e.code} {message}{hint}", e.code) from None
        if not resp.body:
            return None
        return json.loads(resp.body)

    async def iter_users(self, state: str = "ready") -> AsyncIterator[dict]:
        """Every user with a server in ``state``, following the Hub's pagination."""
        offset = 0
        while True:
            page = await self.request(
                "GET", "/users", state=state, offset=offset, limit=self.page_size
            )
            if isinstance(page, list):  # a Hub without pagination
                for user in page:
                    yield user
                return
            items = page.get("items", [])
            for user in items:
                yield user
            nxt = (page.get("_pagination") or {}).get("next")
            if not nxt or not items:
                return
            offset = nxt.get("offset", offset + len(items))

    async def list_servers(self) -> list[Server]:
        """All ready servers, with spawner state (needs ``admin:server_state``)."""
        servers: list[Server] = []
        async for user in self.iter_users("ready"):
            servers.extend(servers_of(user))
        return servers

    @staticmethod
    def server_path(user: str, name: str = "") -> str:
        if name:
            return f"/users/{quote(user, safe='')}/servers/{quote(name, safe='')}"
        return f"/users/{quote(user, safe='')}/server"

    async def get_user(self, user: str) -> dict:
        return await self.request("GET", f"/users/{quote(user, safe='')}")

    async def stop_server(self, user: str, name: str = "", wait: float = 120) -> None:
        """Stop a server through the Hub (as jupyterhub-idle-culler does) and wait until it has stopped."""
        path = self.server_path(user, name)
        if name:
            await self.request("DELETE", path, body={"remove": False})
        else:
            await self.request("DELETE", path)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while loop.time() < deadline:
            model = await self.get_user(user)
            s = (model.get("servers") or {}).get(name)
            if not s or (not s.get("ready") and not s.get("pending")):
                return
            await asyncio.sleep(0.5)
        raise HubError(f"{user}/{name}: still stopping after {wait:g}s")

    async def start_server(self, user: str, name: str = "") -> None:
        path = self.server_path(user, name)
        await self.request("POST", path, body={})
