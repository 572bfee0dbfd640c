"""Talking to Kubernetes: a small API-server client and the kubelet checkpoint call.

The kubelet checkpoints a running container with
``POST /checkpoint/{namespace}/{pod}/{container}?timeout=SECONDS`` and answers
``{"items": ["/var/lib/kubelet/checkpoints/checkpoint-<pod>_<ns>-<ctr>-<time>.tar"]}``;
the container keeps running. Two routes reach it:

- ``direct`` (default): ``https://<node>:10250/checkpoint/…`` with the agent's
  ServiceAccount token; RBAC needs only ``nodes/checkpoint`` ``create``.
- ``apiserver-proxy``: ``/api/v1/nodes/{node}/proxy/checkpoint/…`` through the API
  server; needs ``nodes/proxy`` ``create``, which also allows running commands in any
  pod of the node: use it only where the agent cannot reach port 10250.

The direct route verifies the kubelet's serving certificate by default
(``verify_kubelet_tls``) against ``kubelet_ca_file`` (default: the cluster CA from the
ServiceAccount mount, which signs kubelet certificates issued through
``serverTLSBootstrap``); the agent's bearer token is never sent to an unverified peer
unless an admin turns verification off.

Every failure becomes an :class:`AgentError` whose ``fix`` says what to change.
"""

from __future__ import annotations

import json
import os
import ssl
from pathlib import Path
from urllib.parse import quote, urlencode

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from traitlets import Bool, Enum, Float, Instance, Integer, Unicode, default
from traitlets.config import LoggingConfigurable

from ..retry import Backoff
from .errors import AgentError

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def _status_message(body: bytes) -> tuple[str, str]:
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

    def token(self) -> str:
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

    async def _request_once(
        self,
        method: str,
        path: str,
        body: dict | None,
        query: dict | None,
        timeout: float | None,
        ok: tuple[int, ...],
    ) -> dict:
        url = self.api_url.rstrip("/") + path
        if query:
            url += "?" + urlencode(query)
        req = HTTPRequest(
            url,
            method=method,
            headers={
                "Authorization": f"Bearer {self.token()}",
                "Accept": "application/json",
                "Content-Type": "application/json",
            },
            body=json.dumps(body) if body is not None else (b"" if method == "POST" else None),
            request_timeout=timeout or self.request_timeout,
            ca_certs=self.ca_file or None,
        )
        try:
            response = await AsyncHTTPClient().fetch(req, raise_error=False)
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
        if response.code in ok:
            return json.loads(response.body) if response.body else {}
        reason, message = _status_message(response.body)
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


def node_kubelet_address(node: dict) -> tuple[str, int]:
    """(InternalIP or Hostname, kubelet port) from a Node object."""
    status = node.get("status") or {}
    addresses = {a.get("type"): a.get("address") for a in status.get("addresses") or []}
    host = addresses.get("InternalIP") or addresses.get("Hostname") or node["metadata"]["name"]
    port = ((status.get("daemonEndpoints") or {}).get("kubeletEndpoint") or {}).get("Port") or 10250
    return host, int(port)


class KubeletClient(LoggingConfigurable):
    """Asks the kubelet of a node to checkpoint one container."""

    kubelet_route = Enum(
        ["direct", "apiserver-proxy"],
        "direct",
        help="How to reach the kubelet's checkpoint endpoint. 'direct': https://<node>:10250 with "
        "the agent's ServiceAccount token; needs RBAC 'create' on 'nodes/checkpoint' only. "
        "'apiserver-proxy': through /api/v1/nodes/<node>/proxy/checkpoint/...; needs 'create' on "
        "'nodes/proxy', which is broad (it allows exec into any pod of the node): use it only "
        "where the agent cannot reach port 10250.",
    ).tag(config=True)

    kubelet_host = Unicode(
        "",
        help="Host of the kubelet for the direct route. Empty: the node's InternalIP from the "
        "Node object (set it to $(HOST_IP) from the downward API to skip that lookup).",
    ).tag(config=True)

    kubelet_port = Integer(
        0,
        help="Kubelet port for the direct route. 0: the Node's status.daemonEndpoints.kubeletEndpoint.Port "
        "(10250 on most clusters).",
    ).tag(config=True)

    kubelet_scheme = Unicode(
        "https", help="Scheme of the kubelet endpoint: 'https' everywhere except test setups."
    ).tag(config=True)

    kubelet_ca_file = Unicode(
        f"{SA_DIR}/ca.crt",
        help="CA bundle that signs the kubelets' serving certificates, for the direct route. "
        "Default: the cluster CA of the ServiceAccount mount, which signs kubelet certificates "
        "when kubelets run with serverTLSBootstrap: true (approve their kubelet-serving CSRs). "
        "Where kubelets serve certificates of another CA, mount that CA (e.g. a ConfigMap with "
        "the node's /var/lib/kubelet/pki CA) and point this at it.",
    ).tag(config=True)

    timeout_grace = Float(
        15.0,
        help="Seconds to wait for the kubelet beyond the checkpoint timeout passed to it.",
    ).tag(config=True)

    verify_kubelet_tls = Bool(
        True,
        help="Verify the kubelet's TLS certificate against kubelet_ca_file on the direct route. "
        "Turn it off only where kubelets serve self-signed certificates and the node network "
        "is trusted: the agent sends its ServiceAccount token to whatever answers on the "
        "kubelet port.",
    ).tag(config=True)

    def __init__(self, api: KubeAPI, **kwargs):
        super().__init__(**kwargs)
        self.api = api

    async def checkpoint_url(
        self, node: str, namespace: str, pod: str, container: str, timeout: int
    ) -> str:
        path = f"/checkpoint/{quote(namespace)}/{quote(pod)}/{quote(container)}?timeout={timeout}"
        if self.kubelet_route == "apiserver-proxy":
            return f"{self.api.api_url.rstrip('/')}/api/v1/nodes/{quote(node)}/proxy{path}"
        host, port = self.kubelet_host, self.kubelet_port
        if not host or not port:
            node_host, node_port = node_kubelet_address(await self.api.get_node(node))
            host, port = host or node_host, port or node_port
        return f"{self.kubelet_scheme}://{host}:{port}{path}"

    async def checkpoint(
        self, node: str, namespace: str, pod: str, container: str, timeout: int
    ) -> str:
        """Checkpoint ``namespace/pod/container``; return the archive's path on the node."""
        url = await self.checkpoint_url(node, namespace, pod, container, int(timeout))
        proxy = self.kubelet_route == "apiserver-proxy"
        verify = proxy or self.verify_kubelet_tls
        ca = self.api.ca_file if proxy else self.kubelet_ca_file
        kubelet_tls = not proxy and url.startswith("https:") and verify
        if kubelet_tls and not os.path.isfile(ca):
            raise AgentError(
                f"KubeletClient.kubelet_ca_file {ca or '(empty)'} does not exist, so the "
                f"kubelet's certificate on node {node} cannot be verified",
                "set KubeletClient.kubelet_ca_file to the CA that signs the kubelets' serving "
                "certificates (mount it into the agent pod), or, only on a trusted node network "
                "with self-signed kubelet certificates, KubeletClient.verify_kubelet_tls = False",
                500,
            )
        req = HTTPRequest(
            url,
            method="POST",
            body=b"",
            headers={"Authorization": f"Bearer {self.api.token()}", "Accept": "application/json"},
            request_timeout=timeout + self.timeout_grace,
            validate_cert=verify,
            ca_certs=(ca or None) if verify else None,
        )
        where = f"{namespace}/{pod}/{container} on node {node}"
        try:
            response = await AsyncHTTPClient().fetch(req, raise_error=False)
        except ssl.SSLCertVerificationError as e:
            if not kubelet_tls:
                raise AgentError(
                    f"the API server's certificate failed verification: {e.verify_message}",
                    "set KubeAPI.ca_file to the cluster CA (the ServiceAccount's ca.crt)",
                    502,
                ) from e
            raise AgentError(
                f"the kubelet's TLS certificate at {url.split('/checkpoint/')[0]} failed "
                f"verification against KubeletClient.kubelet_ca_file {ca}: {e.verify_message}",
                "set KubeletClient.kubelet_ca_file to the CA that signs the kubelets' serving "
                "certificates (with serverTLSBootstrap: true the cluster CA), or, only on a "
                "trusted node network with self-signed kubelet certificates, "
                "KubeletClient.verify_kubelet_tls = False",
                502,
            ) from e
        except ssl.SSLError as e:
            raise AgentError(
                f"TLS with {url.split('/checkpoint/')[0]} failed: {e}",
                "check KubeletClient.kubelet_scheme and kubelet_port (the kubelet serves https "
                "on 10250)",
                502,
            ) from e
        except HTTPClientError as e:
            raise AgentError(
                f"the kubelet gave no answer within {timeout + self.timeout_grace:g}s checkpointing {where}",
                "raise the checkpoint timeout, or check the container runtime (a large container "
                "takes longer to dump)",
                504,
            ) from e
        except OSError as e:
            raise AgentError(
                f"cannot reach the kubelet at {url.split('/checkpoint/')[0]}: {e}",
                "check that the agent can reach the kubelet port (host network policy), or set "
                "kubelet_route = 'apiserver-proxy'",
                502,
            ) from e
        code = response.code
        if code == 200:
            items = json.loads(response.body).get("items") or []
            if not items:
                raise AgentError(
                    f"the kubelet checkpointed {where} but named no archive",
                    "check the kubelet's log",
                    502,
                )
            return items[0]
        reason, message = _status_message(response.body)
        if code == 599:
            raise AgentError(
                f"the kubelet gave no answer within {timeout + self.timeout_grace:g}s checkpointing {where}",
                "raise the checkpoint timeout, or check the container runtime (a large container "
                "takes longer to dump)",
                504,
            )
        if code == 404:
            raise AgentError(
                f"404 from the kubelet checkpointing {where}: {message or 'not found'}",
                "enable the ContainerCheckpoint feature gate (beta, on by default since 1.30) or "
                "check the timeout parameter",
                502,
            )
        if code in (401, 403):
            need = "nodes/proxy" if proxy else "nodes/checkpoint"
            raise AgentError(
                f"{code} from the {'API server' if proxy else 'kubelet'} checkpointing {where}: "
                f"{message or reason or 'forbidden'}",
                f"grant the agent's ServiceAccount 'create' on '{need}' in its ClusterRole",
                403,
            )
        raise AgentError(
            f"the container runtime failed to checkpoint {where} ({code}): {message or reason}",
            "check that CRIU works on the node ('criu check') and the runtime's log; "
            "the container keeps running",
            502,
        )
