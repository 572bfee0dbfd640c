"""Jupyter activity of a server: kernels, busy kernels, terminals, and their last activity.

Pushed (:class:`JupyterSignal`, the default): the gpusnap server extension in each
single-user server reports its kernels and terminals to ``POST api/servers/{user}/{name}/jupyter``
with the server's own Hub token, at once when a kernel goes busy or idle (or one starts or
stops) and every ``GpuSnapReporter.interval`` seconds otherwise
(``jupyterhub_gpusnap/serverext/report.py``); each report says that interval. The service keeps
each server's newest report here and reads it every tick, so it needs no key to the servers:
its token lacks ``access:servers`` and cannot read a user's files or start a kernel
(docs/security.md). A server that has not reported for :data:`STALE_AFTER` of its intervals
gives no Jupyter signal, and "no signal" is never "idle".

Polled, where the admin opts in (:class:`JupyterPollSignal` in ``GpuSnap.signal_classes``, and
the service's role then needs ``access:servers``: ``service_role(..., jupyter_poll=True)``):
servers with no fresh report are read through the JupyterHub proxy, as a browser would, but always with
``?no_track_activity=1``: a poll without it counts as user activity and would keep every
server alive forever. ``/api/status``'s ``last_activity`` is not used as activity either,
since an open JupyterLab tab polls the REST API every few seconds and moves it; only
kernels and terminals count.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from tornado.httpclient import AsyncHTTPClient, HTTPRequest, HTTPResponse
from traitlets import Bool, Float, Unicode, default

from ..model import Sample, Server
from .base import SignalSource


class JupyterAccessError(RuntimeError):
    """The server could not be read with the service's token (or has not reported)."""


class ReportError(ValueError):
    """A server's report is malformed; the message says what to send."""


#: The most kernels or terminals one report may list.
MAX_REPORT_ITEMS = 1000

#: A report is believed for this many of the server's report intervals (one lost report is
#: no gap; a server silent for longer gives no signal).
STALE_AFTER = 3

#: The report intervals a server may announce (seconds).
REPORT_INTERVALS = (1.0, 3600.0)


@dataclass
class Report:
    """One server's kernels and terminals as its extension reported them.

    ``received`` is the service's clock when the report came in; ``kernels`` are
    ``{"execution_state", "last_activity"}`` and ``terminals`` ``{"last_activity"}``, the
    fields of ``/api/kernels`` and ``/api/terminals`` the signal uses.
    """

    received: float
    kernels: list[dict]
    terminals: list[dict]
    interval: float = 60.0  # the server reports again within this many seconds

    @property
    def fresh_until(self) -> float:
        return self.received + STALE_AFTER * self.interval

    @classmethod
    def from_body(cls, body: dict, received: float) -> Report:
        """A report from the JSON body of ``POST …/jupyter``; ReportError if it is malformed."""
        out = {}
        for field in ("kernels", "terminals"):
            items = body.get(field)
            if not isinstance(items, list) or len(items) > MAX_REPORT_ITEMS:
                raise ReportError(
                    f"'{field}' must be a list of at most {MAX_REPORT_ITEMS} objects, as in "
                    f'/api/{field}, e.g. {{"kernels": [{{"execution_state": "idle", '
                    f'"last_activity": "2026-11-22T18:00:00Z"}}], "terminals": []}}'
                )
            clean = []
            for item in items:
                if not isinstance(item, dict):
                    raise ReportError(f"each of '{field}' must be an object")
                stamp = item.get("last_activity")
                if stamp is not None:
                    try:
                        if not isinstance(stamp, str):
                            raise ValueError
                        parse_iso8601(stamp)
                    except (ValueError, OverflowError):
                        raise ReportError(
                            f"'last_activity' of {field} must be an ISO 8601 time, got {str(stamp)[:40]!r}"
                        ) from None
                entry = {"last_activity": stamp}
                if field == "kernels":
                    state = item.get("execution_state")
                    if state is not None and not isinstance(state, str):
                        raise ReportError(
                            '\'execution_state\' must be a string such as "idle" or "busy"'
                        )
                    entry["execution_state"] = state
                clean.append(entry)
            out[field] = clean
        interval = body.get("interval", 60.0)
        low, high = REPORT_INTERVALS
        if (
            isinstance(interval, bool)
            or not isinstance(interval, (int, float))
            or not low <= interval <= high
        ):
            raise ReportError(
                f"'interval' must be the seconds until the next report, from {low:g} to {high:g}"
            )
        return cls(
            received=received,
            kernels=out["kernels"],
            terminals=out["terminals"],
            interval=float(interval),
        )


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
    """Kernels, busy kernels and terminals of a single-user server: its reports, or a poll."""

    name = "jupyter"

    #: Whether servers with no fresh report are read through the proxy (JupyterPollSignal).
    poll = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.reports: dict[str, Report] = {}

    def record(self, key: str, report: Report) -> None:
        """Keep ``report`` as server ``key``'s newest (the API calls this for a server's own token)."""
        self.reports[key] = report

    def forget(self, key: str) -> None:
        self.reports.pop(key, None)

    def carry_over(self, key: str, sample: dict | None) -> None:
        """Take server ``key``'s Jupyter reading from before a service restart (the stored
        sample) as a report received when it was taken, unless a newer report came in: a
        restart then neither restarts idle clocks nor calls anyone idle while the servers
        report again (each does within its interval)."""
        if not sample or sample.get("kernels") is None or sample.get("time") is None:
            return
        if key in self.reports:
            return
        stamp = sample.get("jupyter_last_activity")
        iso = (
            datetime.fromtimestamp(stamp, timezone.utc).isoformat().replace("+00:00", "Z")
            if stamp is not None
            else None
        )
        busy = int(sample.get("kernels_busy") or 0)
        kernels = [
            {"execution_state": "busy" if i < busy else "idle", "last_activity": iso}
            for i in range(int(sample["kernels"]))
        ]
        terminals = [{"last_activity": iso} for _ in range(int(sample.get("terminals") or 0))]
        self.reports[key] = Report(
            received=float(sample["time"]), kernels=kernels, terminals=terminals
        )

    async def prefetch(self, servers: list[Server]) -> None:
        """Drop the stale reports of servers not running (called once per tick). A fresh one
        stays: a restored server may report before the Hub lists it as running again."""
        running = {s.key for s in servers}
        clock = time.time()
        for key in [
            k for k, r in self.reports.items() if k not in running and r.fresh_until < clock
        ]:
            del self.reports[key]

    def from_report(self, report: Report, now: float) -> Sample:
        """The sample a report gives at ``now``."""
        return self.summarise(report.kernels, report.terminals, now)

    def summarise(self, kernels: list[dict], terminals: list[dict], now: float) -> Sample:
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

    proxy_url = Unicode(
        "http://127.0.0.1:8000",
        help="""Only for JupyterPollSignal (polling): public URL of JupyterHub (its proxy) as this
        service reaches it, without a trailing path, e.g. ``http://127.0.0.1:8000`` or ``http://proxy-public.jhub.svc``.
        Each server is read at this URL plus its prefix (``/user/alice/``), so a
        ``JupyterHub.base_url`` belongs in the server's URL, not here.""",
    ).tag(config=True)

    api_token = Unicode(
        "",
        help="""Token sent as ``Authorization: token …`` to every single-user server.
        Used only with ``poll`` on. Defaults to ``$JUPYTERHUB_API_TOKEN``, the service's own
        token when the Hub manages it; its role then needs the ``access:servers`` scope,
        otherwise the proxy answers every request with a redirect to the login page.""",
    ).tag(config=True)

    @default("api_token")
    def _api_token_default(self) -> str:
        return os.environ.get("JUPYTERHUB_API_TOKEN", "")

    request_timeout = Float(
        5.0,
        help="""Only for JupyterPollSignal (polling): seconds one HTTP request to a server may take
        (connect and read).
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
        help="""Only for JupyterPollSignal (polling): reach a server directly at the address its
        spawner records in the spawner state
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
        report = self.reports.get(server.key)
        clock = time.time()
        if report is not None and clock <= report.fresh_until:
            return self.from_report(report, now)
        if self.poll:
            return await self.read_by_poll(server, now)
        if report is None:
            raise JupyterAccessError(
                f"{server.key} has not reported its kernels: enable the gpusnap server extension in "
                "its image (jupyter server extension enable jupyterhub_gpusnap.serverext), give server "
                "tokens access to the service (hubconfig.server_token_scopes), or poll servers "
                "(JupyterPollSignal in GpuSnap.signal_classes)"
            )
        raise JupyterAccessError(
            f"{server.key} last reported its kernels {clock - report.received:.0f}s ago, more than "
            f"{STALE_AFTER} of its {report.interval:g}s intervals; its server log says why (gpusnap: …)"
        )

    async def read_by_poll(self, server: Server, now: float) -> Sample:
        """Read ``server``'s kernels and terminals through the proxy (``poll`` on)."""
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
        return self.summarise(kernels, terminals, now)


class JupyterPollSignal(JupyterSignal):
    """:class:`JupyterSignal` that also polls servers which do not report, through the proxy.

    An admin's opt-in for servers whose image lacks jupyterhub-gpusnap's server extension:
    list it in ``GpuSnap.signal_classes`` instead of JupyterSignal, and give the service's role
    ``access:servers`` (``service_role("gpusnap", jupyter_poll=True)``). The trade-off: with
    that scope a leaked service token reads every running server's files and runs code in it
    (docs/security.md). Servers that do report are still read from their reports.
    """

    poll = True
