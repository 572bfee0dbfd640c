"""The one Kubernetes API-server client: JSON over tornado with the in-cluster defaults.

Used by the checkpoint backend (checkpoint records), the agent signal and the spawner
(which node a pod runs on, the agent pods), the node agent (pods, nodes, token reviews)
and the doctor (SelfSubjectAccessReviews, nodes, PVCs). Calls that get no answer or a 5xx
are tried again with :class:`~jupyterhub_gpusnap.retry.Backoff`; every failure is an
:class:`~.errors.AgentError` whose ``fix`` says what to change.
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote, urlencode

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from traitlets import Float, Instance, Unicode, default
from traitlets.config import LoggingConfigurable

from ..retry import Backoff
from .errors import AgentError

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def status_message(body: bytes) -> tuple[str, str]:
    """(reason, message) of a Kubernetes Status body, or ("", text) for anything else."""
    try:
        status = json.loads(body)
        return status.get("reason", ""), status.get("message", "")
    except (ValueError, AttributeError):
        return "", (body or b"")[:300].decode(errors="replace").strip()


class KubeAPI(LoggingConfigurable):
    """A minimal Kubernetes API client (JSON over tornado) with the in-cluster defaults."""

    api_url = Unicode(
        help="URL of the Kubernetes API server. Default: the in-cluster address from "
        "KUBERNETES_SERVICE_HOST / KUBERNETES_SERVICE_PORT.",
    ).tag(config=True)

    @default("api_url")
    def _default_api_url(self) -> str:
        host = os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if ":" in host:
            host = f"[{host}]"
        return f"https://{host}:{port}"

    token_file = Unicode(
        f"{SA_DIR}/token",
        help="File holding the bearer token for the API server (the pod's projected "
        "ServiceAccount token). It is re-read on every request, so rotation just works.",
    ).tag(config=True)

    ca_file = Unicode(
        help="CA bundle of the API server. Default: the ServiceAccount's ca.crt if mounted.",
    ).tag(config=True)

    @default("ca_file")
    def _default_ca(self) -> str:
        path = f"{SA_DIR}/ca.crt"
        return path if os.path.exists(path) else ""

    request_timeout = Float(20.0, help="Seconds one API server request may take.").tag(config=True)

    backoff = Instance(Backoff)

    @default("backoff")
    def _default_backoff(self) -> Backoff:
        # c.KubeAPI.Backoff… (the agent's); the hub side passes the AgentLocator's
        return Backoff(parent=self)

    #: Credentials from a kubeconfig (:meth:`from_kubeconfig`): an ``ssl.SSLContext`` with the
    #: cluster CA and any client certificate, and a function returning the bearer token ("" for
    #: none). ``None``: ``ca_file`` and ``token_file``, the in-cluster ServiceAccount.
    ssl_context: ssl.SSLContext | None = None
    token_source: Callable[[], str] | None = None

    @classmethod
    async def from_kubeconfig(cls, kubeconfig: str = "", **kwargs) -> KubeAPI:
        """A client with the in-cluster ServiceAccount, or outside a cluster with ``kubeconfig``
        (default: $KUBECONFIG or ~/.kube/config), as ``kubectl`` finds its credentials."""
        from kubernetes_asyncio import config
        from kubernetes_asyncio.client import Configuration

        conf = Configuration()
        if kubeconfig and not os.path.exists(os.path.expanduser(kubeconfig)):
            raise FileNotFoundError(f"kubeconfig {kubeconfig} not found")
        try:
            if kubeconfig:
                raise config.ConfigException("kubeconfig given")
            config.load_incluster_config(client_configuration=conf)
        except config.ConfigException:
            await config.load_kube_config(config_file=kubeconfig or None, client_configuration=conf)
        api = cls(api_url=conf.host, ca_file=conf.ssl_ca_cert or "", **kwargs)
        if conf.host.startswith("https"):
            ctx = ssl.create_default_context(cafile=conf.ssl_ca_cert or None)
            if conf.cert_file:
                ctx.load_cert_chain(conf.cert_file, conf.key_file)
            if not conf.verify_ssl:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            api.ssl_context = ctx

        def token() -> str:
            if getattr(conf, "refresh_api_key_hook", None):
                conf.refresh_api_key_hook(conf)
            value = conf.api_key.get("BearerToken") or conf.api_key.get("authorization") or ""
            return value.removeprefix("Bearer ")

        api.token_source = token
        return api

    def token(self) -> str:
        if self.token_source is not None:
            return self.token_source()
        try:
            return Path(self.token_file).read_text().strip()
        except OSError as e:
            raise AgentError(
                f"cannot read the ServiceAccount token at {self.token_file}: {e}",
                "run in a pod with automountServiceAccountToken: true, or set token_file",
                500,
            ) from e

    async def request(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        query: dict | None = None,
        timeout: float | None = None,
        ok: tuple[int, ...] = (200, 201),
        retry: bool = True,
    ) -> dict:
        """Send a JSON request; raise AgentError (with the RBAC verb to grant on 403).

        No answer and 5xx are tried again with :attr:`backoff`, a 4xx never is. A create
        (POST) answered 409 AlreadyExists, or a DELETE answered 404, on a second or later try
        means an earlier try went through and only its answer was lost: done, ``{}`` is
        returned (the object is not created or deleted twice). ``retry=False``: one try (a
        periodic read, whose next tick is its retry).
        """
        once = lambda: self._request_once(method, path, body, query, timeout, ok)  # noqa: E731
        if not retry:
            return await once()
        done_if = {"POST": 409, "DELETE": 404}.get(method)
        tries = 0

        async def attempt() -> dict:
            nonlocal tries
            tries += 1
            try:
                return await once()
            except AgentError as e:
                if tries > 1 and e.code == done_if:
                    self.log.info(
                        "API server: %s %s answered %d on try %d: an earlier try went through",
                        method, path, e.code, tries,
                    )  # fmt: skip
                    return {}
                raise

        return await self.backoff.run(
            attempt,
            lambda e: isinstance(e, AgentError) and e.code >= 500,
            f"API server: {method} {path}",
        )

    async def answer(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        """One try, the answer as it comes: ``(HTTP status, JSON body)``, ``(0, {"message":
        why})`` when the API server cannot be reached. For a report of what the API server
        says (``jupyterhub-gpusnap doctor``), where a refusal is a finding, not an error."""
        try:
            response = await self._fetch(method, path, body, None, None)
        except AgentError as e:
            return 0, {"message": e.message}
        try:
            data = json.loads(response.body) if response.body else {}
        except ValueError:
            data = {"message": response.body.decode(errors="replace")[:200]}
        return response.code, data if isinstance(data, dict) else {}

    async def _fetch(
        self,
        method: str,
        path: str,
        body: dict | None,
        query: dict | None,
        timeout: float | None,
    ):
        """Send one request; AgentError when no answer comes, the response otherwise."""
        url = self.api_url.rstrip("/") + path
        if query:
            url += "?" + urlencode(query)
        headers = {"Accept": "application/json", "Content-Type": "application/json"}
        token = self.token()
        if token or self.token_source is None:
            headers["Authorization"] = f"Bearer {token}"
        req = HTTPRequest(
            url,
            method=method,
            headers=headers,
            body=json.dumps(body) if body is not None else (b"" if method == "POST" else None),
            request_timeout=timeout or self.request_timeout,
            ca_certs=self.ca_file or None,
            ssl_options=self.ssl_context,
        )
        try:
            return await AsyncHTTPClient().fetch(req, raise_error=False)
        except HTTPClientError as e:  # timeouts (599) raise even with raise_error=False
            raise AgentError(
                f"no answer from the API server for {method} {path}: {e}",
                "check api_url and that the API server is reachable",
                504,
            ) from e
        except OSError as e:
            raise AgentError(
                f"cannot reach the Kubernetes API server at {self.api_url}: {e}",
                "check api_url and the network policy between this pod and the API server",
                502,
            ) from e

    async def _request_once(
        self,
        method: str,
        path: str,
        body: dict | None,
        query: dict | None,
        timeout: float | None,
        ok: tuple[int, ...],
    ) -> dict:
        response = await self._fetch(method, path, body, query, timeout)
        if response.code in ok:
            return json.loads(response.body) if response.body else {}
        reason, message = status_message(response.body)
        if response.code == 599:
            raise AgentError(
                f"no answer from the API server for {method} {path}: {response.error}",
                "check api_url and that the API server is reachable",
                504,
            )
        if response.code == 403:
            raise AgentError(
                f"the API server refused {method} {path}: {message or reason}",
                "grant the ServiceAccount the verb and resource named in the message "
                "(see the agent's ClusterRole in the Helm values)",
                403,
            )
        if response.code == 401:
            raise AgentError(
                f"the API server did not accept our token for {method} {path}",
                "check token_file: it must be a valid ServiceAccount token",
                401,
            )
        raise AgentError(
            f"the API server answered {response.code} to {method} {path}: {message or reason}",
            "check the names in the request"
            if response.code == 404
            else "check the API server's log",
            response.code if response.code >= 400 else 502,
        )

    async def get_pod(self, namespace: str, name: str) -> dict:
        return await self.request(
            "GET", f"/api/v1/namespaces/{quote(namespace)}/pods/{quote(name)}"
        )

    async def list_pods(
        self,
        namespace: str | None = None,
        label_selector: str = "",
        field_selector: str = "",
        retry: bool = True,
    ) -> list[dict]:
        path = f"/api/v1/namespaces/{quote(namespace)}/pods" if namespace else "/api/v1/pods"
        query = {}
        if label_selector:
            query["labelSelector"] = label_selector
        if field_selector:
            query["fieldSelector"] = field_selector
        return (await self.request("GET", path, query=query, retry=retry)).get("items") or []

    async def get_node(self, name: str) -> dict:
        return await self.request("GET", f"/api/v1/nodes/{quote(name)}")

    async def access_review(self, attributes: dict) -> dict:
        """Ask the API server whether our own ServiceAccount may do ``attributes``
        (a SelfSubjectAccessReview, which every authenticated identity may create)."""
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": attributes},
        }
        result = await self.request(
            "POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", body=review
        )
        return result.get("status") or {}

    async def token_review(self, token: str) -> dict:
        """Ask the API server who ``token`` belongs to: the TokenReview's ``status``."""
        review = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token},
        }
        result = await self.request(
            "POST", "/apis/authentication.k8s.io/v1/tokenreviews", body=review
        )
        return result.get("status") or {}
