"""Jupyter activity of a server: kernels, busy kernels, terminals, and their last activity.

Read through the JupyterHub proxy, as a browser would, but always with
``?no_track_activity=1``: a poll without it counts as user activity and would
keep every server alive forever. ``/api/status``'s ``last_activity`` is not
used as activity either, since an open JupyterLab tab polls the REST API every
few seconds and moves it; only kernels and terminals count.
"""

from __future__ import annotations

import asyncio
import json
import os
from datetime import datetime, timezone

from tornado.httpclient import AsyncHTTPClient, HTTPRequest, HTTPResponse
from traitlets import Bool, Float, Unicode, default

from ..model import Sample, Server
from .base import SignalSource


class JupyterAccessError(RuntimeError):
    """The server could not be read with the service's token."""


def parse_iso8601(value: str | None) -> float | None:
    """Epoch seconds of a Jupyter timestamp like ``2026-11-22T20:41:49.123456Z``.

    Jupyter writes UTC with a ``Z`` suffix; a timestamp without a zone is UTC too.
    """
    if not value:
        return None
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    stamp = datetime.fromisoformat(text)
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)
    return stamp.timestamp()


class JupyterSignal(SignalSource):
    """Kernels, busy kernels and terminals of a single-user server, read through the proxy."""

    name = "jupyter"

    proxy_url = Unicode(
        "http://127.0.0.1:8000",
        help="""Public URL of JupyterHub (its proxy) as this service reaches it, without a
        trailing path, e.g. ``http://127.0.0.1:8000`` or ``http://proxy-public.jhub.svc``.
        Each server is read at this URL plus its prefix (``/user/alice/``), so a
        ``JupyterHub.base_url`` belongs in the server's URL, not here.""",
    ).tag(config=True)

    api_token = Unicode(
        "",
        help="""Token sent as ``Authorization: token …`` to every single-user server.
        Defaults to ``$JUPYTERHUB_API_TOKEN``, the service's own token when the Hub manages it;
        its role needs the ``access:servers`` scope, otherwise the proxy answers every
        request with a redirect to the login page.""",
    ).tag(config=True)

    @default("api_token")
    def _api_token_default(self) -> str:
        return os.environ.get("JUPYTERHUB_API_TOKEN", "")

    request_timeout = Float(
        5.0,
        help="""Seconds one HTTP request to a server may take (connect and read).
        Keep it below ``timeout``, which bounds the whole reading of one server.""",
    ).tag(config=True)

    starting_grace = Float(
        300.0,
        help="""Seconds a kernel in ``execution_state == "starting"`` counts as busy after its last
        activity. jupyter_server reports a new kernel as "starting" until some client first talks
        to it, and a kernel started through the REST API that no browser ever connected to keeps
        that state for good; past this grace it counts as an idle kernel, so it cannot keep a
        server running forever. A ``busy`` kernel always counts as busy.""",
    ).tag(config=True)

    def is_busy(self, kernel: dict, now: float) -> bool:
        """Whether a kernel model from ``/api/kernels`` is running code (or still starting)."""
        state = kernel.get("execution_state")
        if state == "busy":
            return True
        if state == "starting":
            since = parse_iso8601(kernel.get("last_activity"))
            return since is None or now - since < self.starting_grace
        return False

    direct = Bool(
        True,
        help="""Reach a server directly at the address its spawner records in the spawner state
        (``gpusnap_url``, set by the Snap spawners) instead of through the proxy. The proxy counts
        every request it forwards as activity (configurable-http-proxy updates the route's
        last_activity, which the Hub then reports), so polling through it would move the Hub's
        last_activity for jupyterhub-idle-culler and the admin page; ``no_track_activity=1`` only
        keeps the single-user server's own clock still. Servers without that state key are read
        through the proxy.""",
    ).tag(config=True)

    def url(self, server: Server, path: str) -> str:
        """The URL of ``path`` (e.g. ``api/kernels``) on ``server``, activity-neutral."""
        prefix = server.url or f"/user/{server.user}/{server.name + '/' if server.name else ''}"
        if not prefix.endswith("/"):
            prefix += "/"
        base = self.proxy_url
        if self.direct and (server.state or {}).get("gpusnap_url"):
            base = server.state["gpusnap_url"]
        return f"{base.rstrip('/')}{prefix}{path}?no_track_activity=1"

    async def _get(self, server: Server, path: str, allow_404: bool = False) -> object | None:
        """GET one API path of ``server`` and return its JSON body (``None`` on an allowed 404)."""
        url = self.url(server, path)
        request = HTTPRequest(
            url,
            method="GET",
            headers={"Authorization": f"token {self.api_token}", "Accept": "application/json"},
            follow_redirects=False,
            connect_timeout=self.request_timeout,
            request_timeout=self.request_timeout,
        )
        try:
            response: HTTPResponse = await AsyncHTTPClient().fetch(request, raise_error=False)
        except OSError as e:  # refused, unresolvable: raised even with raise_error=False
            raise JupyterAccessError(
                f"cannot reach {url}: {e}; check JupyterSignal.proxy_url"
            ) from None
        if response.code == 599:
            raise JupyterAccessError(f"cannot reach {url}: {response.error}")
        if response.code in (301, 302, 303, 307, 308):
            location = response.headers.get("Location", "")
            raise JupyterAccessError(
                f"{url} redirected to {location or 'the login page'}: the service's token lacks "
                "the access:servers scope (add it to the service's role in the Hub config), "
                "or the server is not running behind this proxy_url"
            )
        if response.code == 404 and allow_404:
            return None
        if response.code in (401, 403):
            raise JupyterAccessError(
                f"{url}: HTTP {response.code}: the server refused the token; check "
                "JupyterSignal.api_token and that its role has the access:servers scope"
            )
        if response.code != 200:
            raise JupyterAccessError(f"{url}: HTTP {response.code} {response.reason}")
        try:
            return json.loads(response.body)
        except ValueError as e:
            raise JupyterAccessError(f"{url}: answer is not JSON ({e})") from None

    async def read(self, server: Server, now: float) -> Sample:
        status, kernels, terminals = await asyncio.gather(
            self._get(server, "api/status"),
            self._get(server, "api/kernels"),
            self._get(server, "api/terminals", allow_404=True),  # 404: terminals disabled
        )
        if not isinstance(status, dict):
            raise JupyterAccessError(f"{server.key}: /api/status is not a JSON object")
        if not isinstance(kernels, list):
            raise JupyterAccessError(f"{server.key}: /api/kernels is not a JSON list")
        terminals = terminals if isinstance(terminals, list) else []
        busy = sum(1 for k in kernels if self.is_busy(k, now))
        stamps = [parse_iso8601(item.get("last_activity")) for item in [*kernels, *terminals]]
        stamps = [s for s in stamps if s is not None]
        return Sample(
            time=now,
            kernels=len(kernels),
            kernels_busy=busy,
            terminals=len(terminals),
            jupyter_last_activity=max(stamps) if stamps else None,
        )
