"""The service's HTML pages: a user's status page, the keep-running link from the warning email,
and the admin overview. Hub OAuth logs people in; the pages' actions call the REST API with the
same cookie (and the xsrf token), so the rules of handlers/base.py apply unchanged.
"""

from __future__ import annotations

import time
from datetime import datetime

from jupyterhub.services.auth import HubOAuth
from tornado import web

from ..model import State, server_key
from .api import parse_until
from .base import BaseHandler

#: What the history and admin pages count as a server's snapshots and restores.
HISTORY_KINDS = {
    "suspend": "suspended",
    "suspend_failed": "suspend failed",
    "restore": "restored",
    "restore_failed": "restore failed",
    "park": "parked",
    "unpark": "unparked",
    "stop": "stopped",
}


def fmt_duration(seconds: float | None) -> str:
    """45 s, 12 min, 1 h 05 min, 3 d 1 h (the same words as the Lab panel)."""
    if seconds is None:
        return "—"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    m = s // 60
    if m < 60:
        return f"{m} min"
    h = m // 60
    if h < 48:
        return f"{h} h {m % 60:02d} min" if m % 60 else f"{h} h"
    d = h // 24
    return f"{d} d {h % 24} h" if h % 24 else f"{d} d"


def fmt_bytes(n: float | None) -> str:
    if not n:
        return "—"
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    v, i = float(n), 0
    while v >= 1024 and i < len(units) - 1:
        v, i = v / 1024, i + 1
    return (
        f"{int(v)} B" if i == 0 else (f"{v:.1f} {units[i]}" if v < 10 else f"{round(v)} {units[i]}")
    )


def fmt_time(iso: str | None) -> str:
    """Server-side text of a time (UTC); the page's script rewrites it in the reader's zone."""
    if not iso:
        return "—"
    t = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    return t.strftime("%Y-%m-%d %H:%M UTC")


def keep_choices(max_seconds: float | None) -> list[tuple[int, str]]:
    """Keep-running choices within the admin's maximum, the maximum last."""
    if not max_seconds or max_seconds <= 0:
        return []
    steps = [1800, 3600, 7200, 4 * 3600, 8 * 3600, 24 * 3600]
    out = [(s, fmt_duration(s)) for s in steps if s < max_seconds]
    out.append((int(max_seconds), f"{fmt_duration(max_seconds)} (the maximum)"))
    return out


#: The keep-running choice selected at first, on every page and in the Lab panel: 1 h (or less).
DEFAULT_KEEP_SECONDS = 3600


def default_keep(choices: list[tuple[int, str]]) -> int | None:
    """The choice selected at first: the longest up to DEFAULT_KEEP_SECONDS, else the shortest."""
    fit = [secs for secs, _ in choices if secs <= DEFAULT_KEEP_SECONDS]
    return fit[-1] if fit else (choices[0][0] if choices else None)


#: States an exempt server reaches only by a "Suspend now": shown as they are, not as "Exempt".
BEYOND_EXEMPT = ("suspending", "suspended", "restoring", "failed")


def badge_state(s: dict) -> str:
    """The state a server's badge shows: "exempt" for an exempt server, unless a "Suspend
    now" took it to one of BEYOND_EXEMPT (then that state)."""
    return "exempt" if s.get("exempt") and s["state"] not in BEYOND_EXEMPT else s["state"]


def state_words(s: dict) -> str:
    """The State row of a server in plain words (the Lab panel says the same)."""
    state = s["state"]
    kept = s.get("keep_until") and not s.get("exempt")
    # an exempt server can still be suspended by hand ("Suspend now"): what happens to it
    # comes before the exemption
    if badge_state(s) == "exempt":
        return "Exempt: never suspended."
    if state == "active":
        if kept:
            return f"Active — kept running until {fmt_time(s['keep_until'])}."
        return f"Active ({s['reason']})." if s.get("reason") else "Active."
    if state in ("idle", "warned"):
        since = fmt_time(s.get("idle_since") or s.get("last_active"))
        if kept:
            return f"Idle since {since} — kept running until {fmt_time(s['keep_until'])}."
        warned = "; you were warned" if state == "warned" else ""
        return f"Idle since {since}{warned}: nothing ran and nobody used it."
    if state == "parked":
        return f"Idle; its GPU memory waits in host RAM since {fmt_time(s['state_since'])}."
    if state == "suspending":
        return "Being suspended: its kernels are being saved to disk."
    if state == "suspended":
        if s.get("action") == "stop":
            return f"Stopped at {fmt_time(s['state_since'])} to free the GPU."
        return f"Suspended at {fmt_time(s['state_since'])} to free the GPU; your kernels are saved."
    if state == "restoring":
        return "Being restored from its snapshot."
    if state == "failed":
        return f"Suspending it failed ({s.get('failure') or s.get('reason')}); it keeps running."
    return state


def history(events: list[dict], limit: int = 8) -> list[dict]:
    """Suspensions and restores of one server, newest first, with size and restore time."""
    rows = []
    for e in events:
        if e["kind"] not in HISTORY_KINDS:
            continue
        d = e.get("detail") or {}
        size = (
            fmt_bytes(d.get("image_bytes") or d.get("bytes"))
            if (d.get("image_bytes") or d.get("bytes"))
            else ""
        )
        if d.get("gpu_bytes"):
            size += f" (GPU {fmt_bytes(d['gpu_bytes'])})"
        rows.append(
            {
                "time": e["time"],
                "what": HISTORY_KINDS[e["kind"]] + (f": {d['error']}" if d.get("error") else ""),
                "size": size,
                "took": f"{d['restore_s']:.1f} s"
                if isinstance(d.get("restore_s"), (int, float))
                else "",
            }
        )
    return rows[:limit]


def gpu_hours_given_back(events: list[dict], suspended: set[str], now: float) -> float:
    """GPU-hours freed by suspensions, from the event log: each suspend until the next
    restore of the same server (or until now while it is still suspended), times its GPU count."""
    total = 0.0
    open_since: dict[str, tuple[float, int]] = {}
    for e in sorted(events, key=lambda e: e["id"]):
        d = e.get("detail") or {}
        if e["kind"] == "suspend":
            open_since[e["key"]] = (e["time"], int(d.get("gpu_count") or 0))
        elif e["kind"] in ("restore", "restore_failed", "stop") and e["key"] in open_since:
            since, gpus = open_since.pop(e["key"])
            total += max(0.0, e["time"] - since) * gpus
    for key, (since, gpus) in open_since.items():
        if key in suspended:
            total += max(0.0, now - since) * gpus
    return total / 3600


class PageHandler(BaseHandler):
    """An HTML page behind Hub OAuth: anonymous visitors go to the Hub's login."""

    @property
    def hub_auth(self) -> HubOAuth:
        # The login keeps its OAuth state (PKCE code verifier) in memory, in the HubOAuth that
        # starts it; HubOAuthCallbackHandler finishes it with HubOAuth.instance(), so use that one.
        return HubOAuth.instance()

    def render_page(self, template: str, **ns) -> None:
        model = self.current_user
        self.render(
            template,
            prefix=self.gpusnap.service_prefix.rstrip("/") + "/",
            me=model,
            is_admin=self.is_admin(model),
            can_read_all=self.can_read_all(model),
            fmt_duration=fmt_duration,
            fmt_bytes=fmt_bytes,
            fmt_time=fmt_time,
            keep_choices=keep_choices,
            default_keep=default_keep,
            state_words=state_words,
            badge_state=badge_state,
            hub_prefix=self.hub_auth.hub_prefix,
            history=history,
            **ns,
        )

    def write_error(self, status_code: int, **kwargs) -> None:
        message = self._reason
        exc = kwargs.get("exc_info")
        if exc and isinstance(exc[1], web.HTTPError) and exc[1].log_message:
            message = exc[1].log_message % exc[1].args if exc[1].args else exc[1].log_message
        try:
            self.render_page("error.html", status_code=status_code, message=message)
        except Exception:
            self.finish(f"<h1>{status_code}</h1><p>{web.escape.xhtml_escape(message)}</p>")

    def find(self, user: str, name: str | None, write: bool = False):
        """The status of user/name if the caller may see it (owner, reader; admins to act)."""
        model = self.current_user
        name = name or ""
        allowed = self.owns(model, user) or (
            self.is_admin(model) if write else self.can_read_all(model)
        )
        if not allowed:
            raise web.HTTPError(404, f"No server {server_key(user, name)} that you may see")
        status = self.service.get(server_key(user, name))
        if status is None:
            raise web.HTTPError(
                404,
                f"gpusnap has not seen {server_key(user, name)} yet: start the server, "
                "and it appears here within one interval",
            )
        return status


class UserPage(PageHandler):
    """{prefix} (all of my servers) and {prefix}status/{user}[/{name}] (one server)."""

    @web.authenticated
    async def get(self, user: str | None = None, name: str | None = None) -> None:
        service = self.service
        if user is None:
            mine = [s for s in service.all() if s.user == self.current_user["name"]]
            servers = [service.model(s) for s in sorted(mine, key=lambda s: s.key)]
        else:
            servers = [service.model(self.find(user, name))]
        self.render_page("user.html", servers=servers, single=user is not None)


class KeepPage(PageHandler):
    """{prefix}keep/{user}[/{name}]: the warning email's link. GET asks, POST keeps it running."""

    @web.authenticated
    async def get(self, user: str, name: str | None = None) -> None:
        status = self.find(user, name, write=True)
        self.render_page("keep.html", s=self.service.model(status), done=False)

    @web.authenticated
    async def post(self, user: str, name: str | None = None) -> None:
        # HubOAuth accepts the cookie on a POST only with a valid _xsrf field (checked in prepare)
        status = self.find(user, name, write=True)
        body = {}
        if self.get_body_argument("until", None):
            body["until"] = self.get_body_argument("until")
        else:
            try:
                body["seconds"] = float(self.get_body_argument("seconds", ""))
            except ValueError:
                raise web.HTTPError(400, "Choose how long to keep the server running") from None
        until = parse_until(body, time.time())
        try:
            status = self.service.keep(status.key, until)
        except (KeyError, ValueError) as e:
            raise web.HTTPError(400, str(e)) from None
        self.gpusnap.log.info(
            "%s: kept running until %s by %s (keep page)",
            status.key,
            status.keep_until,
            self.current_user["name"],
        )
        self.render_page("keep.html", s=self.service.model(status), done=True)


class AdminPage(PageHandler):
    """{prefix}admin: every server at a glance; custom:gpusnap:read to see, admin to act."""

    @web.authenticated
    async def get(self) -> None:
        if not self.can_read_all(self.current_user):
            raise web.HTTPError(
                403,
                "The admin page needs the custom:gpusnap:read scope (ask your hub admin for the gpusnap-readers role)",
            )
        app = self.gpusnap
        statuses = sorted(self.service.all(), key=lambda s: s.key)
        servers = []
        for s in statuses:
            m = self.service.model(s)
            last = next((e for e in m["events"] if e["kind"] == "suspend"), None)
            m["last_snapshot"] = (last or {}).get("detail") or {}
            servers.append(m)
        events = self.service.events(None, limit=5000)
        suspended = {s.key for s in statuses if s.state == State.suspended}
        counts: dict[str, int] = {}
        for m in servers:
            shown = badge_state(m)
            counts[shown] = counts.get(shown, 0) + 1
        self.render_page(
            "admin.html",
            servers=servers,
            counts=counts,
            gpu_hours=gpu_hours_given_back(events, suspended, time.time()),
            snapshots=sum(1 for e in events if e["kind"] == "suspend"),
            snapshot_bytes=sum(
                (e.get("detail") or {}).get("image_bytes") or 0
                for e in events
                if e["kind"] == "suspend"
            ),
            action=app.action,
        )


SERVER = r"(?P<user>[^/]+)(?:/(?P<name>[^/]*))?"


def page_handlers(prefix: str) -> list[tuple[str, type]]:
    """The pages' routes under the service prefix."""
    return [
        (prefix, UserPage),
        (prefix + r"status/" + SERVER, UserPage),
        (prefix + r"keep/" + SERVER, KeepPage),
        (prefix + r"admin/?", AdminPage),
    ]
