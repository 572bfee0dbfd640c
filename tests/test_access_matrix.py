"""Who may do what: every REST endpoint and page × every kind of caller, against a real hub and service.

One hub, one service and four servers (alice/, alice/lab, bob/, bob/spare, spawned together) serve
the whole matrix, so it stays fast. The service's action is "stop" with an hour-long idle window, so
nothing is stopped unless a test asks; the suspend cases run last: the refused ones first, then each
caller allowed to suspend stops a server of its own (a suspension with action "stop" stops it).

Callers: anonymous, another user (bob on alice's servers), the owner (alice's API token, and her
single-user server's own token read from the server process's environment), a reader
(custom:gpusnap:read), a gpusnap admin (custom:gpusnap:admin), a Hub admin (admin:servers), the
service's own token and a token alice limited to ``read:users:name``. The last two lack
``access:services!service=gpusnap``, so the service treats them as no login at all. For every 200
the body must not carry another user's data.

Then least privilege, end to end: the service's token cannot read a user's files or start a
kernel, only a server's own token reports that server's kernels, and a busy kernel, reported by
the server's extension (the service cannot poll), keeps its server from being called idle.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode

import pytest
from tornado.httpclient import AsyncHTTPClient, HTTPRequest

from tests.helpers.access_hub import EXTRA_HUB_CONFIG, SERVERS, start_hub_and_service
from tests.helpers.gpusnap_service import GpuSnapService

pytestmark = pytest.mark.e2e

CALLERS = [
    "anonymous",
    "other",
    "owner",
    "owner_server",
    "reader",
    "admin",
    "hub_admin",
    "service",
    "owner_limited",
]

#: Callers that must never see another user's data: who they are → the user whose data they may see.
PRIVATE = {
    "other": "bob",
    "owner": "alice",
    "owner_server": "alice",
    "service": None,
    "owner_limited": None,
}
USERS = ("alice", "bob")


def expect(anonymous, other, owner, reader, admin, owner_server=None, hub_admin=None) -> dict:
    """Expected status per caller; the server's own token acts as its owner, a Hub admin as an
    admin; tokens without access to the service (the service's own, alice's limited one) as
    nobody."""
    return {
        "anonymous": anonymous,
        "other": other,
        "owner": owner,
        "owner_server": owner if owner_server is None else owner_server,
        "reader": reader,
        "admin": admin,
        "hub_admin": admin if hub_admin is None else hub_admin,
        "service": anonymous,
        "owner_limited": anonymous,
    }


ANY_USER = expect(anonymous=403, other=200, owner=200, reader=200, admin=200)
READ_SERVER = expect(anonymous=403, other=404, owner=200, reader=200, admin=200)
WRITE_SERVER = expect(anonymous=403, other=404, owner=200, reader=403, admin=200)
ADMIN_ONLY = expect(anonymous=403, other=404, owner=403, reader=403, admin=200)
READERS = expect(anonymous=403, other=403, owner=403, reader=200, admin=200)
ADMINS = expect(anonymous=403, other=403, owner=403, reader=403, admin=200)
MISSING = expect(anonymous=403, other=404, owner=404, reader=404, admin=404)
#: a server's Jupyter report: its own server token only
REPORT = expect(anonymous=403, other=403, owner=403, reader=403, admin=403, owner_server=200)
# pages: anonymous visitors are sent to the Hub's login (a POST without a login is refused)
NOBODY_PAGE = {"anonymous": 302, "service": 302, "owner_limited": 302}
PAGE_ANY_USER = {**ANY_USER, **NOBODY_PAGE}
PAGE_READ_SERVER = {**READ_SERVER, **NOBODY_PAGE}
PAGE_WRITE_SERVER = {**READ_SERVER, "reader": 404, **NOBODY_PAGE}
PAGE_WRITE_SERVER_POST = {
    **PAGE_WRITE_SERVER,
    "anonymous": 403,
    "service": 403,
    "owner_limited": 403,
}
PAGE_READERS = {**READERS, **NOBODY_PAGE}


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
    Case("POST", "api/servers/alice/jupyter", REPORT, body={"kernels": [], "terminals": []}),
    Case(
        "POST",
        "api/servers/bob/jupyter",
        {**REPORT, "owner_server": 403},
        body={"kernels": [], "terminals": []},
    ),
    # alice/'s token is not alice/lab's either
    Case(
        "POST",
        "api/servers/alice/lab/jupyter",
        {**REPORT, "owner_server": 403},
        body={"kernels": [], "terminals": []},
    ),
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
        "owner_limited": await hub.user_token("alice", scopes=["read:users:name!user=alice"]),
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
        for caller in ["other", "owner", "owner_server", "reader", "admin", "hub_admin"]:
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


LEAST_PRIVILEGE_SETTINGS = """
c.GpuSnap.interval = 1
c.GpuSnap.idle_window = 8
c.GpuSnap.min_running = 0
c.GpuSnap.warn_before = 0
c.GpuSnap.action = "stop"
"""


async def proxy_request(hub, path: str, token: str, method: str = "GET", body: dict | None = None):
    """``path`` under the proxy's root with ``token``; (status, body text). No redirects followed."""
    req = HTTPRequest(
        hub.url + path,
        method=method,
        headers={"Authorization": f"token {token}"},
        body=None if body is None and method == "GET" else json.dumps(body or {}),
        follow_redirects=False,
        request_timeout=30,
    )
    resp = await AsyncHTTPClient().fetch(req, raise_error=False)
    return resp.code, resp.body.decode("utf8", "replace") if resp.body else ""


async def test_the_service_reaches_no_server_and_a_busy_kernel_reported_by_its_server_counts(
    hub_factory, tmp_path
):
    service = GpuSnapService(tmp_path / "gpusnap", LEAST_PRIVILEGE_SETTINGS)
    hub = await hub_factory(service.hub_config() + EXTRA_HUB_CONFIG)
    await asyncio.gather(hub.start_server("alice"), hub.start_server("bob"))
    busy_cell = None
    try:
        secret = "the-secret-of-alice-" + tmp_path.name
        (hub.home_root / "alice" / "secret.txt").write_text(secret)
        alice = await hub.user_token("alice")

        # the service's own token: no file of alice's, no kernel in her server
        code, me = await hub.api("GET", "/user", token=service.token)
        assert code == 200 and not any(s.startswith("access:servers") for s in me["scopes"]), me
        code, text = await proxy_request(hub, "user/alice/api/contents/secret.txt", service.token)
        assert code in (403, 404) and secret not in text, (code, text[:300])
        code, text = await proxy_request(hub, "user/alice/api/kernels", service.token, "POST", {})
        assert code in (403, 404), (code, text[:300])
        # (the same requests with alice's token do it: the refusals above are the scopes')
        code, text = await proxy_request(hub, "user/alice/api/contents/secret.txt", alice)
        assert code == 200 and secret in text, (code, text[:300])

        # alice runs a silent, long cell; only her server's extension can tell the service
        code, kernel = await hub.user_request("alice", "api/kernels", "POST", {})
        assert code == 201, kernel
        busy_cell = asyncio.ensure_future(
            hub.execute(
                "alice", "import time; time.sleep(600)", kernel_id=kernel["id"], timeout=900
            )
        )

        async def kernel_busy():
            code, model = await hub.user_request(
                "alice", f"api/kernels/{kernel['id']}?no_track_activity=1"
            )
            return code == 200 and model["execution_state"] == "busy"

        await service.wait_for(kernel_busy, what="alice's cell to run")
        await service.start(hub)

        async def alice_busy():
            status = await service.server_status("alice/")
            return status if status and status["signals"].get("kernels_busy") == 1 else None

        seen = await service.wait_for(
            alice_busy, what="alice's busy kernel, as her server reported it"
        )
        assert "jupyter" not in seen["signals"].get("errors", {}), seen
        started = asyncio.get_running_loop().time()

        # bob's server, idle, is stopped by the same rule; alice's stays while the cell runs
        async def bob_stopped():
            return await hub.get_server("bob") is None

        await service.wait_for(bob_stopped, what="bob's idle server to be stopped")

        async def past_two_windows():
            return asyncio.get_running_loop().time() - started > 2 * 8

        await service.wait_for(past_two_windows, what="two idle windows to pass")
        status = await service.server_status("alice/")
        assert await hub.get_server("alice") is not None, "alice's busy server was stopped"
        assert status["state"] == "active" and status["signals"]["kernels_busy"] == 1, status

        # the cell ends (interrupt): her server reports an idle kernel, and now it goes
        code, _ = await hub.user_request(
            "alice", f"api/kernels/{kernel['id']}/interrupt", "POST", {}
        )
        assert code == 204

        async def alice_stopped():
            return await hub.get_server("alice") is None

        await service.wait_for(
            alice_stopped, timeout=90, what="alice's server, idle now, to be stopped"
        )
    finally:
        if busy_cell is not None:
            busy_cell.cancel()
        await service.stop()
