"""The kubelet checkpoint call (the API-server client is :mod:`jupyterhub_gpusnap.kube.api`).

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
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from traitlets import Bool, Enum, Float, Integer, Unicode
from traitlets.config import LoggingConfigurable

from ..kube.api import SA_DIR, KubeAPI, status_message
from ..kube.errors import AgentError


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
        reason, message = status_message(response.body)
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
