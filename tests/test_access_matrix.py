"""Who may do what: every REST endpoint and page × every kind of caller, against a real hub and service.

One hub, one service and four servers (alice/, alice/lab, bob/, bob/spare, spawned together) serve
the whole matrix, so it stays fast. The service's action is "stop" with an hour-long idle window, so
nothing is stopped unless a test asks; the suspend cases run last: the refused ones first, then each
caller allowed to suspend stops a server of its own (a suspension with action "stop" stops it).

Callers: anonymous, another user (bob on alice's servers), the owner (alice's API token, and her
single-user server's own token read from the server process's environment), a reader
(custom:gpusnap:read), a gpusnap admin (custom:gpusnap:admin), a Hub admin (admin:servers) and the
service's own token. For every 200 the body must not carry another user's data.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode

import pytest
from gpusnap_service import GpuSnapService
from tornado.httpclient import AsyncHTTPClient, HTTPRequest

pytestmark = pytest.mark.e2e

SETTINGS = """
c.GpuSnap.interval = 1
c.GpuSnap.idle_window = 3600
c.GpuSnap.min_running = 3600
c.GpuSnap.warn_before = 0
c.GpuSnap.action = "stop"
"""

#: Users with gpusnap roles, and a Hub admin; they need no servers of their own.
EXTRA_HUB_CONFIG = """
c.JupyterHub.allow_named_servers = True
c.Authenticator.admin_users = {"hank"}
c.JupyterHub.load_roles.extend([
    {"name": "gpusnap-readers", "users": ["rita"], "scopes": ["custom:gpusnap:read"]},
    {"name": "gpusnap-admins", "users": ["adam"], "scopes": ["custom:gpusnap:admin"]},
])
"""

CALLERS = ["anonymous", "other", "owner", "owner_server", "reader", "admin", "hub_admin", "service"]

#: Callers that must never see another user's data: who they are → the user whose data they may see.
PRIVATE = {"other": "bob", "owner": "alice", "owner_server": "alice", "service": None}
USERS = ("alice", "bob")


def expect(
    anonymous, other, owner, reader, admin, service, owner_server=None, hub_admin=None
) -> dict:
    """Expected status per caller; the server's own token acts as its owner, a Hub admin as an admin."""
    return {
        "anonymous": anonymous,
        "other": other,
        "owner": owner,
        "owner_server": owner if owner_server is None else owner_server,
        "reader": reader,
        "admin": admin,
        "hub_admin": admin if hub_admin is None else hub_admin,
        "service": service,
    }


ANY_USER = expect(anonymous=403, other=200, owner=200, reader=200, admin=200, service=200)
READ_SERVER = expect(anonymous=403, other=404, owner=200, reader=200, admin=200, service=404)
WRITE_SERVER = expect(anonymous=403, other=404, owner=200, reader=403, admin=200, service=404)
ADMIN_ONLY = expect(anonymous=403, other=404, owner=403, reader=403, admin=200, service=404)
READERS = expect(anonymous=403, other=403, owner=403, reader=200, admin=200, service=403)
ADMINS = expect(anonymous=403, other=403, owner=403, reader=403, admin=200, service=403)
MISSING = expect(anonymous=403, other=404, owner=404, reader=404, admin=404, service=404)
# pages: anonymous visitors are sent to the Hub's login (a POST without a login is refused)
PAGE_ANY_USER = {**ANY_USER, "anonymous": 302}
PAGE_READ_SERVER = {**READ_SERVER, "anonymous": 302}
PAGE_WRITE_SERVER = {**READ_SERVER, "reader": 404, "anonymous": 302}
PAGE_WRITE_SERVER_POST = {**PAGE_WRITE_SERVER, "anonymous": 403}
PAGE_READERS = {**READERS, "anonymous": 302}


@dataclass
class Case:
    method: str
    path: str
    expected: dict
    body: dict | None = None
    form: dict | None = None
    #: the server key a 200 must describe (per-server endpoints)
    server: str | None = None


API_CASES = [
    Case("GET", "api/info", ANY_USER),
    Case("GET", "api/servers", ANY_USER),
    Case("GET", "api/servers?state=active", ANY_USER),
    Case("GET", "api/servers/alice", READ_SERVER, server="alice/"),
    Case("GET", "api/servers/alice/", READ_SERVER, server="alice/"),
    Case("GET", "api/servers/alice/lab", READ_SERVER, server="alice/lab"),
    Case("GET", "api/servers/nobody/", MISSING),
    Case("GET", "api/servers/alice/nothing-here", MISSING),
    Case("POST", "api/servers/alice/keep", WRITE_SERVER, body={"seconds": 600}, server="alice/"),
    Case(
        "POST",
        "api/servers/alice/lab/keep",
        WRITE_SERVER,
        body={"seconds": 600},
        server="alice/lab",
    ),
    Case("POST", "api/servers/nobody/keep", {**MISSING, "reader": 403}, body={"seconds": 600}),
    Case("POST", "api/servers/alice/exempt", ADMIN_ONLY, body={"exempt": False}, server="alice/"),
    Case(
        "POST",
        "api/servers/alice/lab/exempt",
        ADMIN_ONLY,
        body={"exempt": False},
        server="alice/lab",
    ),
    Case("GET", "api/events", READERS),
    Case("POST", "api/make-room", ADMINS, body={"bytes": 1024}),
    Case("POST", "api/make-room", ADMINS, body={"bytes": 1024, "gpu": 0}),
    Case("GET", "api/events?server=alice/", READ_SERVER),
    Case("GET", "api/events?server=alice/lab&limit=5", READ_SERVER),
    Case("GET", "metrics", READERS),
]

PAGE_CASES = [
    Case("GET", "", PAGE_ANY_USER),
    Case("GET", "status/alice/", PAGE_READ_SERVER),
    Case("GET", "status/alice/lab", PAGE_READ_SERVER),
    Case("GET", "keep/alice/", PAGE_WRITE_SERVER),
    Case("POST", "keep/alice/lab", PAGE_WRITE_SERVER_POST, form={"seconds": "900"}),
    Case("GET", "admin", PAGE_READERS),
]

#: Suspend: who may not (tried first, on alice's servers); who may (202), each on a server of its own.
SUSPEND_DENIED = {c: s for c, s in WRITE_SERVER.items() if s != 200}
SUSPEND_ALLOWED = {
    "owner": "alice/lab",
    "admin": "bob/",
    "hub_admin": "bob/spare",
    "owner_server": "alice/",
}
assert set(SUSPEND_ALLOWED) == {c for c, s in WRITE_SERVER.items() if s == 200}

#: The servers running at the start; bob/spare is there to be suspended.
SERVERS = ("alice/", "alice/lab", "bob/", "bob/spare")


def server_token(pid: int) -> str:
    """The single-user server's own Hub token, from its process environment (we run as root)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    for item in environ:
        if item.startswith(b"JUPYTERHUB_API_TOKEN="):
            return item.split(b"=", 1)[1].decode()
    raise AssertionError(f"no JUPYTERHUB_API_TOKEN in the environment of pid {pid}")


async def call(hub, case: Case, token: str | None) -> tuple[int, dict, str]:
    """One request through the proxy; (status, headers, body text). No redirects are followed."""
    headers = {"Authorization": f"token {token}"} if token else {}
    body = None
    if case.form is not None:
        body = urlencode(case.form)
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    elif case.body is not None or case.method == "POST":
        body = json.dumps(case.body or {})
        headers["Content-Type"] = "application/json"
    req = HTTPRequest(
        f"{hub.url}services/gpusnap/{case.path}",
        method=case.method,
        headers=headers,
        body=body,
        follow_redirects=False,
        request_timeout=30,
    )
    resp = await AsyncHTTPClient().fetch(req, raise_error=False)
    if resp.code == 599:
        raise OSError(f"{case.method} {case.path}: {resp.error}")
    return resp.code, dict(resp.headers), resp.body.decode("utf8", "replace") if resp.body else ""


async def start_hub_and_service(hub_factory, tmp_path, servers=SERVERS, settings: str = SETTINGS):
    """A hub with ``servers`` running (spawned together), the readers/admins roles, and the service.

    Returns (hub, service) once the service lists every one of them as running.
    """
    service = GpuSnapService(tmp_path / "gpusnap", settings)
    hub = await hub_factory(service.hub_config() + EXTRA_HUB_CONFIG)
    for user in {key.partition("/")[0] for key in servers}:
        await hub.ensure_user(user)
    await asyncio.gather(*(hub.start_server(*key.split("/")) for key in servers))
    await service.start(hub)

    async def all_seen():
        code, data = await service.api("GET", "api/servers")
        return code == 200 and {s["server"] for s in data["servers"] if s["running"]} == set(
            servers
        )

    await service.wait_for(all_seen, what=f"the service to list {sorted(servers)}")
    return hub, service


async def caller_tokens(hub, service) -> dict[str, str | None]:
    alice_server = await hub.get_server("alice")
    assert alice_server and alice_server.get("state", {}).get("pid"), alice_server
    return {
        "anonymous": None,
        "other": await hub.user_token("bob"),
        "owner": await hub.user_token("alice"),
        "owner_server": server_token(alice_server["state"]["pid"]),
        "reader": await hub.user_token("rita"),
        "admin": await hub.user_token("adam"),
        "hub_admin": await hub.user_token("hank"),
        "service": service.token,
    }


def leaks(caller: str, text: str) -> list[str]:
    """Other users' names found in a body that ``caller`` may not see beyond its own."""
    if caller not in PRIVATE:
        return []
    return [u for u in USERS if u != PRIVATE[caller] and u in text]


def check(case: Case, caller: str, code: int, headers: dict, text: str) -> list[str]:
    """What is wrong with one answer (empty when it is right)."""
    want = case.expected[caller]
    label = f"{case.method} {case.path or '/'} as {caller}"
    if code != want:
        return [f"{label}: {code}, expected {want}: {text[:300]}"]
    problems = []
    if code == 200:
        found = leaks(caller, text)
        if found:
            problems.append(f"{label}: the body names {found}: {text[:300]}")
        if case.server:
            data = json.loads(text)
            if data.get("server") != case.server:
                problems.append(f"{label}: describes {data.get('server')}, not {case.server}")
    if code == 302 and "/hub/" not in headers.get("Location", ""):
        problems.append(f"{label}: redirects to {headers.get('Location')}, not the Hub's login")
    if case.path.startswith("api/") and code != 200 and code != 202:
        # API errors are JSON with a message that says what to do
        try:
            error = json.loads(text)
        except ValueError:
            return problems + [f"{label}: error body is not JSON: {text[:200]}"]
        if error.get("status") != code or not error.get("message"):
            problems.append(f"{label}: error body {error}")
    return problems


async def test_access_matrix(hub_factory, tmp_path):
    hub, service = await start_hub_and_service(hub_factory, tmp_path)
    try:
        tokens = await caller_tokens(hub, service)
        problems: list[str] = []
        answers = 0
        for case in API_CASES + PAGE_CASES:
            for caller in CALLERS:
                code, headers, text = await call(hub, case, tokens[caller])
                answers += 1
                problems += check(case, caller, code, headers, text)
        assert not problems, f"{len(problems)} of {answers} answers are wrong:\n" + "\n".join(
            problems
        )

        # what each kind of caller sees in the list
        visible = {}
        for caller in CALLERS[1:]:
            code, _, text = await call(hub, Case("GET", "api/servers", ANY_USER), tokens[caller])
            visible[caller] = sorted(s["server"] for s in json.loads(text)["servers"])
        everything = sorted(SERVERS)
        assert visible == {
            "other": ["bob/", "bob/spare"],
            "owner": ["alice/", "alice/lab"],
            "owner_server": ["alice/", "alice/lab"],
            "reader": everything,
            "admin": everything,
            "hub_admin": everything,
            "service": [],
        }, visible
        code, _, text = await call(hub, Case("GET", "api/info", ANY_USER), tokens["admin"])
        assert json.loads(text)["admin"] is True
        code, _, text = await call(hub, Case("GET", "api/info", ANY_USER), tokens["reader"])
        assert json.loads(text)["admin"] is False

        # suspend: refused callers first (nothing stops), then each allowed caller on a fresh alice/lab
        for path in ("api/servers/alice/suspend", "api/servers/alice/lab/suspend"):
            case = Case("POST", path, SUSPEND_DENIED)
            for caller in SUSPEND_DENIED:
                code, headers, text = await call(hub, case, tokens[caller])
                problems += check(case, caller, code, headers, text)
        assert not problems, "\n".join(problems)
        assert await hub.get_server("alice", "lab") is not None

        running = set(SERVERS)
        # the server's own token goes last: it ends with alice/
        for caller, key in SUSPEND_ALLOWED.items():
            user, _, name = key.partition("/")
            path = f"api/servers/{user}/{name}/suspend" if name else f"api/servers/{user}/suspend"
            case = Case("POST", path, {caller: 202}, server=key)
            code, headers, text = await call(hub, case, tokens[caller])
            assert code == 202, f"suspend {key} as {caller}: {code} {text}"
            assert json.loads(text)["server"] == key
            assert not leaks(caller, text), text
            # asking again while it goes down joins the suspension under way (or finds it gone)
            code, _, text = await call(hub, case, tokens[caller])
            assert code in (202, 409), f"second suspend of {key} as {caller}: {code} {text}"

            async def stopped_and_dropped(user=user, name=name, key=key):
                # a plain stop leaves no checkpoint, so the service drops the server
                if await hub.get_server(user, name) is not None:
                    return False
                return (await service.api("GET", f"api/servers/{key}"))[0] == 404

            await service.wait_for(
                stopped_and_dropped, what=f"{key} to stop after {caller}'s suspend"
            )
            running.discard(key)
            if caller != "owner_server":  # its token went with its server
                code, _, text = await call(hub, case, tokens[caller])
                assert code == 404 and key in json.loads(text)["message"], f"{code} {text}"
            # only the server asked for was stopped
            for other in running:
                assert await hub.get_server(*other.split("/")) is not None, (
                    f"{other} stopped with {key}"
                )
    finally:
        await service.stop()
