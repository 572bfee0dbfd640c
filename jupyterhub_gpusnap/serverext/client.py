"""How the single-user server reaches the gpusnap service for its own server."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from urllib.parse import quote, urlparse

from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from traitlets import Float, Unicode, default
from traitlets.config import LoggingConfigurable


def service_url_from_env(env: Mapping[str, str], service_name: str = "gpusnap") -> str:
    """The service's base URL (trailing slash) as seen from a single-user server.

    In order: ``GPUSNAP_SERVICE_URL``; the host of this server's public URL
    (``JUPYTERHUB_PUBLIC_URL``, e.g. ``https://hub.example.org/user/alice/``, set when
    ``c.JupyterHub.public_url`` is) + the Hub's base URL (``JUPYTERHUB_BASE_URL``) +
    ``services/<name>/``; else the host of ``JUPYTERHUB_API_URL`` + ``/services/<name>/``, which
    works where the Hub API is reached through the proxy.
    """
    explicit = env.get("GPUSNAP_SERVICE_URL")
    if explicit:
        return explicit if explicit.endswith("/") else explicit + "/"
    public = urlparse(env.get("JUPYTERHUB_PUBLIC_URL", ""))
    if public.scheme and public.netloc:
        base = env.get("JUPYTERHUB_BASE_URL", "/")
        base = "/" + base.strip("/") + "/" if base.strip("/") else "/"
        return f"{public.scheme}://{public.netloc}{base}services/{service_name}/"
    api = urlparse(env.get("JUPYTERHUB_API_URL", "http://127.0.0.1:8081/hub/api"))
    return f"{api.scheme}://{api.netloc}/services/{service_name}/"


class ServiceError(Exception):
    """The service answered with an error (status and its message) or could not be reached (502)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class GpuSnapClient(LoggingConfigurable):
    """Calls the gpusnap service's REST API for this server, with this server's Hub token."""

    service_url = Unicode(
        help="Base URL of the gpusnap service as this server reaches it, e.g. "
        "http://proxy-public/services/gpusnap/ or http://127.0.0.1:8000/services/gpusnap/. "
        "Default: env GPUSNAP_SERVICE_URL (set it with c.Spawner.environment), else "
        "JUPYTERHUB_PUBLIC_URL + services/<service_name>/, else the host of JUPYTERHUB_API_URL "
        "+ /services/<service_name>/. If the Lab panel says the service is unreachable, set this.",
    ).tag(config=True)

    service_name = Unicode(
        "gpusnap",
        help="The service's name in c.JupyterHub.services (its URL prefix is /services/<name>/).",
    ).tag(config=True)

    api_token = Unicode(
        help="Token sent to the service. Default: JUPYTERHUB_API_TOKEN, the server's own token, "
        "which the service accepts as the owner's.",
    ).tag(config=True)

    request_timeout = Float(
        10, help="Seconds to wait for the service before the panel shows it as unreachable."
    ).tag(config=True)

    @default("service_url")
    def _default_service_url(self) -> str:
        return service_url_from_env(os.environ, self.service_name)

    @default("api_token")
    def _default_api_token(self) -> str:
        return os.environ.get("JUPYTERHUB_API_TOKEN", "")

    @property
    def user(self) -> str | None:
        return os.environ.get("JUPYTERHUB_USER") or None

    @property
    def server_name(self) -> str:
        return os.environ.get("JUPYTERHUB_SERVER_NAME", "")

    @property
    def server_key(self) -> str | None:
        """``user/server_name`` of this server, or None outside JupyterHub."""
        return f"{self.user}/{self.server_name}" if self.user else None

    def server_path(self) -> str:
        """The service API path of this server: api/servers/{user}[/{name}]."""
        path = f"api/servers/{quote(self.user or '', safe='')}"
        if self.server_name:
            path += f"/{quote(self.server_name, safe='')}"
        return path

    async def call(
        self, method: str, action: str = "", body: dict | None = None
    ) -> tuple[int, dict]:
        """Call the service for this server; return (status, JSON). Raises ServiceError on failure."""
        if self.user is None:
            raise ServiceError(
                404,
                "This server is not running under JupyterHub (JUPYTERHUB_USER is unset): no gpusnap status",
            )
        base = self.service_url if self.service_url.endswith("/") else self.service_url + "/"
        url = base + self.server_path() + (f"/{action}" if action else "")
        req = HTTPRequest(
            url,
            method=method,
            headers={
                "Authorization": f"token {self.api_token}",
                "Content-Type": "application/json",
            },
            body=json.dumps(body or {}) if method != "GET" else None,
            request_timeout=self.request_timeout,
            follow_redirects=False,
        )
        try:
            resp = await AsyncHTTPClient().fetch(req, raise_error=False)
        except OSError as e:
            raise ServiceError(
                502,
                f"The gpusnap service at {base} is unreachable ({e}); set GPUSNAP_SERVICE_URL for the servers",
            ) from None
        if resp.code == 599:
            raise ServiceError(
                502,
                f"The gpusnap service at {base} is unreachable ({resp.error}); "
                "set GPUSNAP_SERVICE_URL for the servers (c.Spawner.environment)",
            )
        try:
            data = json.loads(resp.body) if resp.body else {}
        except ValueError:
            raise ServiceError(
                502,
                f"{url} answered {resp.code} with something that is not JSON: is {base} the gpusnap service?",
            ) from None
        if resp.code >= 400:
            message = data.get("message") if isinstance(data, dict) else None
            self.log.warning("gpusnap: %s %s -> %s %s", method, url, resp.code, message)
            raise ServiceError(resp.code, message or f"the gpusnap service answered {resp.code}")
        return resp.code, data
