"""A real JupyterHub for tests: the venv's ``jupyterhub`` with configurable-http-proxy in a tmp dir.

Nothing here is a fake. :class:`RealHub` writes a ``jupyterhub_config.py`` (basics + the
test's own config text), starts configurable-http-proxy and the Hub as real processes on
free ports on 127.0.0.1, and offers the calls end-to-end tests need: the REST API with an
admin service token, user tokens, starting/stopping servers and waiting for them, restarting
the Hub (keeping its database and, by default, the proxy), and running code in a kernel
through the proxy over the kernel websocket with the user's own token.

Usage::

    async with RealHub(tmp_path, config="c.JupyterHub.spawner_class = 'simple'") as hub:
        await hub.start_server("alice")
        kernel_id, out = await hub.execute("alice", "print(6 * 7)")

Single-user servers run with the simple spawner as root (``--allow-root``) with their
home under ``<tmp>/home/<user>``; unless the test says otherwise, their tokens may reach the
gpusnap service (``hubconfig.server_token_scopes``) and ``GPUSNAP_SERVICE_URL`` points at it
through the proxy, as docs/install.md configures a hub; :meth:`RealHub.stop` stops them through the API and
then kills any process still working in the hub's tmp dir, so no test leaks servers.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import psutil
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from tornado.websocket import websocket_connect

from .kernel_ws import execute_request
from .ports import free_port

ADMIN_SCOPES = [
    "admin:users",
    "admin:servers",
    "admin:server_state",
    "admin:groups",
    "admin:auth_state",
    "tokens",
    "list:services",
    "read:services",
    "access:servers",
    "access:services",
    "read:hub",
    "proxy",
    "shutdown",
]

TEST_PASSWORD = "gpusnap-test-password"


class HubError(AssertionError):
    """The hub did not do what the test asked (carries the tail of the hub log)."""


class RealHub:
    """One real JupyterHub + configurable-http-proxy in ``root``.

    Parameters
    ----------
    root : Path
        An empty directory (a test's ``tmp_path``); everything lives under it.
    config : str
        Python config text appended to the harness's defaults (may override spawner,
        authenticator, ``default_url``…; may add services with ``.append``).
    cleanup_servers : bool
        ``c.JupyterHub.cleanup_servers``; False keeps servers running across :meth:`restart`.
    env : dict
        Extra environment for the hub process (and so for managed services and servers).
    start_timeout : float
        Seconds to wait for the Hub API, and for a server to become ready.
    """

    def __init__(
        self,
        root: Path | str,
        config: str = "",
        *,
        cleanup_servers: bool = False,
        env: dict | None = None,
        start_timeout: float = 60.0,
    ):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.cleanup_servers = cleanup_servers
        self.extra_env = dict(env or {})
        self.start_timeout = start_timeout
        self.ip = "127.0.0.1"
        self.port = free_port()
        self.hub_port = free_port()
        self.proxy_api_port = free_port()
        self.proxy_token = secrets.token_hex(16)
        self.admin_token = secrets.token_hex(24)
        self.admin_service = "gpusnap-test-admin"
        self.home_root = self.root / "home"
        self.home_root.mkdir(exist_ok=True)
        self.config_file = self.root / "jupyterhub_config.py"
        self.log_file = self.root / "jupyterhub.log"
        self.proxy_log_file = self.root / "proxy.log"
        self.hub_proc: asyncio.subprocess.Process | None = None
        self.proxy_proc: asyncio.subprocess.Process | None = None
        self._user_tokens: dict[str, str] = {}
        self.client = AsyncHTTPClient(force_instance=True)

    # ---------------------------------------------------------------- urls
    @property
    def url(self) -> str:
        """Public URL (through the proxy), with a trailing slash."""
        return f"http://{self.ip}:{self.port}/"

    @property
    def api_url(self) -> str:
        """The Hub REST API through the proxy: ``http://127.0.0.1:PORT/hub/api``."""
        return f"http://{self.ip}:{self.port}/hub/api"

    @property
    def hub_api_url(self) -> str:
        """The Hub REST API directly on the hub's own port (works while the proxy is down)."""
        return f"http://{self.ip}:{self.hub_port}/hub/api"

    def server_url(self, user: str, server: str = "") -> str:
        """Public URL prefix of a user's server, trailing slash."""
        path = f"user/{quote(user)}/"
        if server:
            path += f"{quote(server)}/"
        return self.url + path

    # ---------------------------------------------------------------- config
    def _config_text(self) -> str:
        home = str(self.home_root)
        head = f"""
import sys
c = get_config()  # noqa
c.JupyterHub.authenticator_class = "dummy"
c.DummyAuthenticator.password = {TEST_PASSWORD!r}
c.Authenticator.allow_all = True
c.JupyterHub.spawner_class = "simple"
c.SimpleLocalProcessSpawner.home_dir_template = {home!r} + "/{{username}}"
c.Spawner.cmd = [sys.executable, "-m", "jupyterhub.singleuser"]
c.Spawner.args = ["--allow-root"]
c.Spawner.default_url = "/tree"
c.Spawner.start_timeout = 60
c.Spawner.http_timeout = 60
c.JupyterHub.log_level = "DEBUG"
c.JupyterHub.last_activity_interval = 3600
"""
        tail = f"""
# ---- harness essentials (after the test's text so they always hold)
c.JupyterHub.ip = {self.ip!r}
c.JupyterHub.port = {self.port}
c.JupyterHub.hub_ip = {self.ip!r}
c.JupyterHub.hub_port = {self.hub_port}
c.JupyterHub.db_url = "sqlite:///" + {str(self.root / "jupyterhub.sqlite")!r}
c.JupyterHub.cookie_secret_file = {str(self.root / "cookie_secret")!r}
c.JupyterHub.pid_file = {str(self.root / "jupyterhub.pid")!r}
c.JupyterHub.cleanup_servers = {self.cleanup_servers!r}
c.JupyterHub.cleanup_proxy = False
c.ConfigurableHTTPProxy.should_start = False
c.ConfigurableHTTPProxy.api_url = "http://{self.ip}:{self.proxy_api_port}"
c.ConfigurableHTTPProxy.auth_token = {self.proxy_token!r}
c.JupyterHub.services.append({{"name": {self.admin_service!r}, "api_token": {self.admin_token!r}}})
# what docs/install.md asks of every hub: server tokens may reach the gpusnap service (its
# extension reports the server's kernels there), which the servers find through the proxy.
# Our spawners give their servers' tokens that access by default: set it only for others.
from jupyterhub_gpusnap.hubconfig import server_token_scopes as _gpusnap_token_scopes
if "server_token_scopes" not in c.Spawner and not str(c.JupyterHub.spawner_class).startswith(
    "jupyterhub_gpusnap."
):
    c.Spawner.server_token_scopes = _gpusnap_token_scopes("gpusnap")
_env = dict(c.Spawner.environment) if "environment" in c.Spawner else {{}}
_env.setdefault("GPUSNAP_SERVICE_URL", "http://{self.ip}:{self.port}/services/gpusnap/")
c.Spawner.environment = _env
c.JupyterHub.load_roles.append({{
    "name": "gpusnap-test-admin",
    "scopes": {ADMIN_SCOPES!r},
    "services": [{self.admin_service!r}],
}})
"""
        return head + "\n# ---- test config\n" + self.config + "\n" + tail

    def _env(self) -> dict:
        env = dict(os.environ)
        env.pop("JUPYTERHUB_API_TOKEN", None)
        env["CONFIGPROXY_AUTH_TOKEN"] = self.proxy_token
        env["PYTHONUNBUFFERED"] = "1"
        # The venv's bin first, so jupyterhub-singleuser and friends resolve there.
        env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
        env.update(self.extra_env)
        return env

    # ---------------------------------------------------------------- lifecycle
    async def __aenter__(self) -> RealHub:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start the proxy (unless running) and the hub; return once ``/hub/api`` answers."""
        self.config_file.write_text(self._config_text())
        if self.proxy_proc is None or self.proxy_proc.returncode is not None:
            await self._start_proxy()
        await self._start_hub()

    async def _start_proxy(self) -> None:
        log = open(self.proxy_log_file, "ab")
        self.proxy_proc = await asyncio.create_subprocess_exec(
            "configurable-http-proxy",
            "--ip", self.ip,
            "--port", str(self.port),
            "--api-ip", self.ip,
            "--api-port", str(self.proxy_api_port),
            "--default-target", f"http://{self.ip}:{self.hub_port}",
            "--error-target", f"http://{self.ip}:{self.hub_port}/hub/error",
            "--log-level", "warn",
            stdout=log,
            stderr=log,
            env=self._env(),
            cwd=str(self.root),
        )  # fmt: skip
        log.close()
        await self._wait_port(self.proxy_api_port, "configurable-http-proxy", self.proxy_log_file)

    async def _start_hub(self) -> None:
        log = open(self.log_file, "ab")
        self.hub_proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "jupyterhub",
            "-f",
            str(self.config_file),
            stdout=log,
            stderr=log,
            env=self._env(),
            cwd=str(self.root),
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.hub_proc.returncode is not None:
                raise HubError(
                    f"jupyterhub exited with {self.hub_proc.returncode}:\n{self.log_tail()}"
                )
            try:
                resp = await self.client.fetch(
                    self.api_url + "/", raise_error=False, request_timeout=5
                )
                if resp.code == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise HubError(
                    f"hub API did not answer within {self.start_timeout}s:\n{self.log_tail()}"
                )
            await asyncio.sleep(0.2)

    async def _wait_port(self, port: int, what: str, log: Path) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                _, w = await asyncio.open_connection(self.ip, port)
                w.close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise HubError(
                        f"{what} did not listen on {port}:\n{log.read_text()[-3000:]}"
                    ) from None
                await asyncio.sleep(0.1)

    async def _terminate(
        self, proc: asyncio.subprocess.Process | None, timeout: float = 15
    ) -> None:
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()

    async def stop_hub(self) -> None:
        """Stop the hub process only (SIGTERM); servers keep running unless cleanup_servers."""
        await self._terminate(self.hub_proc)

    async def restart(self, proxy: bool = False, config: str | None = None) -> None:
        """Stop the hub and start it again with the same database (and proxy unless ``proxy``).

        ``config`` replaces the test's config text for the new run.
        """
        await self.stop_hub()
        if proxy:
            await self._terminate(self.proxy_proc)
        if config is not None:
            self.config = config
        await self.start()

    async def stop(self) -> None:
        """Stop the hub and the proxy, and kill every server this hub started.

        Servers are killed (SIGKILL), not stopped through the API: a test's end needs
        no graceful shutdown, and it is much faster.
        """
        await self._terminate(self.hub_proc)
        self.kill_leftovers()
        await self._terminate(self.proxy_proc)
        self.client.close()

    async def stop_all_servers(self) -> None:
        """Stop every running server through the Hub API (gracefully, waiting for each)."""
        await self._stop_all_servers()

    def kill_leftovers(self) -> list[int]:
        """SIGKILL processes of this hub's servers: working in its tmp dir or talking to its API."""
        root = str(self.root.resolve())
        marker = f":{self.hub_port}/"
        me = os.getpid()
        killed = []
        for p in psutil.process_iter(["pid", "cwd"]):
            if p.pid == me:
                continue
            try:
                cwd = p.info.get("cwd") or ""
                ours = cwd == root or cwd.startswith(root + os.sep)
                if not ours:
                    ours = marker in p.environ().get("JUPYTERHUB_API_URL", "")
                if ours:
                    p.kill()
                    killed.append(p.pid)
            except (psutil.Error, OSError):
                continue
        return killed

    # ---------------------------------------------------------------- logs
    def log_text(self) -> str:
        """Everything the hub wrote so far (across restarts)."""
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_text()[-chars:]

    # ---------------------------------------------------------------- REST
    async def api(
        self,
        method: str,
        path: str,
        body: dict | list | None = None,
        token: str | None = None,
        timeout: float = 30,
    ) -> tuple[int, object]:
        """Call the Hub REST API (``path`` under ``/hub/api``); return ``(status, json or text)``.

        Uses the admin service token unless ``token`` is given. Never raises on HTTP errors.
        """
        req = HTTPRequest(
            self.api_url + path,
            method=method,
            headers={"Authorization": f"token {token or self.admin_token}"},
            body=None if body is None else json.dumps(body),
            allow_nonstandard_methods=True,
            request_timeout=timeout,
        )
        resp = await self.client.fetch(req, raise_error=False)
        if (
            resp.code == 599
            and resp.error is not None
            and not isinstance(resp.error, HTTPClientError)
        ):
            raise resp.error
        text = resp.body.decode("utf8", "replace") if resp.body else ""
        try:
            data = json.loads(text) if text else None
        except ValueError:
            data = text
        return resp.code, data

    async def ensure_user(self, username: str) -> dict:
        status, data = await self.api("GET", f"/users/{quote(username)}")
        if status == 200:
            return data
        status, data = await self.api("POST", f"/users/{quote(username)}")
        if status not in (200, 201):
            raise HubError(f"creating user {username}: {status} {data}")
        return data

    async def user_token(self, username: str, scopes: list[str] | None = None) -> str:
        """A new API token owned by ``username`` (created if needed); ``scopes`` None = the user's own."""
        await self.ensure_user(username)
        body: dict = {"note": "gpusnap test"}
        if scopes is not None:
            body["scopes"] = scopes
        status, data = await self.api("POST", f"/users/{quote(username)}/tokens", body)
        if status not in (200, 201):
            raise HubError(f"token for {username}: {status} {data}")
        return data["token"]

    async def default_user_token(self, username: str) -> str:
        """The token :meth:`execute` and :meth:`user_request` use for ``username`` (made once)."""
        return await self._default_user_token(username)

    async def _default_user_token(self, username: str) -> str:
        if username not in self._user_tokens:
            self._user_tokens[username] = await self.user_token(username)
        return self._user_tokens[username]

    async def get_server(self, user: str, name: str = "") -> dict | None:
        """The server model from ``GET /users/{user}`` (with spawner state), or None if not running."""
        status, data = await self.api("GET", f"/users/{quote(user)}")
        if status != 200:
            return None
        return data.get("servers", {}).get(name)

    def _server_path(self, user: str, name: str) -> str:
        return (
            f"/users/{quote(user)}/servers/{quote(name)}"
            if name
            else f"/users/{quote(user)}/server"
        )

    async def start_server(
        self, user: str, name: str = "", options: dict | None = None, timeout: float | None = None
    ) -> dict:
        """Spawn ``user/name`` (creating the user) and wait until ready; return the server model."""
        await self.ensure_user(user)
        status, data = await self.api("POST", self._server_path(user, name), options or {})
        if status not in (201, 202, 400):
            raise HubError(f"spawn {user}/{name}: {status} {data}\n{self.log_tail()}")
        if status == 400 and "already running" not in str(data):
            raise HubError(f"spawn {user}/{name}: {status} {data}\n{self.log_tail()}")
        return await self.wait_ready(user, name, timeout)

    async def wait_ready(self, user: str, name: str = "", timeout: float | None = None) -> dict:
        """Wait until ``user/name`` is ready; raise with the hub log if it stops pending first."""
        deadline = time.monotonic() + (timeout or self.start_timeout)
        while True:
            server = await self.get_server(user, name)
            if server and server.get("ready"):
                return server
            if server is None or (not server.get("pending") and not server.get("ready")):
                # not (yet) registered: allow a moment for the POST to land, then fail
                if time.monotonic() > deadline:
                    raise HubError(f"{user}/{name} is not running:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise HubError(
                    f"{user}/{name} not ready within timeout: {server}\n{self.log_tail()}"
                )
            await asyncio.sleep(0.2)

    async def stop_server(
        self, user: str, name: str = "", timeout: float | None = None, check: bool = True
    ) -> None:
        """Stop ``user/name`` through the API and wait until the Hub lists it as gone."""
        status, data = await self.api("DELETE", self._server_path(user, name))
        if check and status not in (202, 204):
            raise HubError(f"stop {user}/{name}: {status} {data}\n{self.log_tail()}")
        deadline = time.monotonic() + (timeout or self.start_timeout)
        while await self.get_server(user, name) is not None:
            if time.monotonic() > deadline:
                if check:
                    raise HubError(f"{user}/{name} did not stop:\n{self.log_tail()}")
                return
            await asyncio.sleep(0.2)

    async def browser(self, username: str, password: str = TEST_PASSWORD) -> Browser:
        """A logged-in browser-like session (cookies, redirects): exercises the OAuth flows."""
        b = Browser(self.url)
        await b.login(username, password)
        return b

    # ---------------------------------------------------------------- through the proxy
    async def user_request(
        self,
        user: str,
        path: str,
        method: str = "GET",
        body: dict | None = None,
        server: str = "",
        token: str | None = None,
    ) -> tuple[int, object]:
        """Request ``path`` on a user's server through the proxy with the user's token."""
        token = token or await self._default_user_token(user)
        req = HTTPRequest(
            self.server_url(user, server) + path.lstrip("/"),
            method=method,
            headers={"Authorization": f"token {token}"},
            body=None if body is None else json.dumps(body),
            allow_nonstandard_methods=True,
            follow_redirects=False,
            request_timeout=30,
        )
        resp = await self.client.fetch(req, raise_error=False)
        text = resp.body.decode("utf8", "replace") if resp.body else ""
        try:
            return resp.code, (json.loads(text) if text else None)
        except ValueError:
            return resp.code, text

    async def execute(
        self,
        user: str,
        code: str,
        kernel_id: str | None = None,
        server: str = "",
        token: str | None = None,
        timeout: float = 60,
    ) -> tuple[str, str]:
        """Run ``code`` in a kernel of ``user``'s server through the proxy; return (kernel_id, output).

        Creates a kernel over REST when ``kernel_id`` is None. Output is the concatenated
        ``stream`` text, ``execute_result`` text/plain and error ``ename: evalue``.
        """
        token = token or await self._default_user_token(user)
        if kernel_id is None:
            status, data = await self.user_request(user, "api/kernels", "POST", {}, server, token)
            if status != 201:
                raise HubError(f"creating a kernel for {user}/{server}: {status} {data}")
            kernel_id = data["id"]
        ws_url = self.server_url(user, server).replace("http://", "ws://", 1)
        session = uuid.uuid4().hex
        ws_url += f"api/kernels/{kernel_id}/channels?session_id={session}"
        try:
            conn = await asyncio.wait_for(
                websocket_connect(HTTPRequest(ws_url, headers={"Authorization": f"token {token}"})),
                timeout,
            )
        except HTTPClientError as e:  # no such kernel (a fresh server?): say what the Hub did
            warned = [ln for ln in self.log_text().splitlines() if ln.startswith(("[W", "[E"))]
            raise HubError(
                f"kernel {kernel_id} of {user}/{server}: {e}; the Hub's warnings and errors:\n"
                + "\n".join(warned[-20:])
            ) from e
        try:
            msg_id, message = execute_request(code, session=session, username=user)
            await conn.write_message(message)
            out: list[str] = []
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise HubError(f"no reply from kernel {kernel_id} within {timeout}s; got {out}")
                raw = await asyncio.wait_for(conn.read_message(), left)
                if raw is None:
                    raise HubError(f"kernel websocket {kernel_id} closed; got {out}")
                if isinstance(raw, bytes):
                    continue
                reply = json.loads(raw)
                if reply.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind = reply.get("msg_type")
                content = reply.get("content", {})
                if kind == "stream":
                    out.append(content.get("text", ""))
                elif kind in ("execute_result", "display_data"):
                    out.append(content.get("data", {}).get("text/plain", ""))
                elif kind == "error":
                    out.append(f"{content.get('ename')}: {content.get('evalue')}")
                elif kind == "status" and content.get("execution_state") == "idle":
                    return kernel_id, "".join(out)
        finally:
            conn.close()


class Browser:
    """A minimal browser over HTTP: a cookie jar and manual redirects, no JavaScript.

    Enough to log in to the Hub with a password and to open a server or a service
    page through their OAuth dance, the way a user's browser does.
    """

    def __init__(self, base_url: str):
        from http.cookies import SimpleCookie

        self.base_url = base_url.rstrip("/")
        self.cookies = SimpleCookie()
        self.client = AsyncHTTPClient(force_instance=True)
        self.history: list[tuple[int, str]] = []

    def _cookie_header(self) -> str:
        return "; ".join(f"{k}={m.value}" for k, m in self.cookies.items())

    async def request(
        self,
        path_or_url: str,
        method: str = "GET",
        body: str | None = None,
        max_redirects: int = 15,
    ):
        """Fetch, following redirects and keeping cookies; return the final response."""
        from urllib.parse import urljoin

        url = path_or_url if "://" in path_or_url else self.base_url + path_or_url
        for _ in range(max_redirects):
            headers = {"Cookie": self._cookie_header()} if self.cookies else {}
            if body is not None:
                headers["Content-Type"] = "application/x-www-form-urlencoded"
            resp = await self.client.fetch(
                HTTPRequest(
                    url,
                    method=method,
                    body=body,
                    headers=headers,
                    follow_redirects=False,
                    request_timeout=30,
                ),
                raise_error=False,
            )
            for header in resp.headers.get_list("Set-Cookie"):
                self.cookies.load(header)
            self.history.append((resp.code, url))
            if resp.code in (301, 302, 303, 307) and "Location" in resp.headers:
                url = urljoin(url, resp.headers["Location"])
                if resp.code != 307:
                    method, body = "GET", None
                continue
            return resp
        raise HubError(f"too many redirects: {self.history[-max_redirects:]}")

    async def login(self, username: str, password: str) -> None:
        import re
        from urllib.parse import urlencode

        page = await self.request("/hub/login")
        m = re.search(rb'name="_xsrf" value="([^"]+)"', page.body or b"")
        form = {"username": username, "password": password}
        if m:
            form["_xsrf"] = m.group(1).decode()
        resp = await self.request("/hub/login?next=%2Fhub%2Fhome", "POST", urlencode(form))
        if "jupyterhub-session-id" not in self.cookies or resp.code >= 400:
            raise HubError(f"login as {username} failed: {resp.code} {self.history[-3:]}")

    def close(self) -> None:
        self.client.close()
