"""The node agents seen from the hub side: where they run, how to reach them, one client.

:class:`AgentConnection` holds the agent settings once (``c.AgentConnection.…``: namespace
and label of the agent pods, port, scheme, token) and calls an agent's JSON API; the
doctor reads them directly, the service and the spawner through :class:`AgentLocator`
(which also finds a server's pod), the Kubernetes checkpoint backend's. An agent's
``{"error", "fix"}`` answer becomes an :class:`AgentError`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from traitlets import Float, Instance, Integer, Unicode, default
from traitlets.config import LoggingConfigurable

from ..retry import Backoff
from .api import KubeAPI
from .errors import AgentError

if TYPE_CHECKING:
    from ..model import Server

#: Namespace of the agent DaemonSet in helm-values/agent/ and the Helm values' default.
AGENT_NAMESPACE = "gpusnap-system"


def safe_name(text: str) -> str:
    """Lowercase ``[a-z0-9-]`` form of a user or server name (for pod and repository names)."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "x"


def agent_failure_is_transient(method: str, code: int, agent_said: bool) -> bool:
    """Whether a failed call to a node agent is worth another try.

    ``code`` 0: the agent could not be reached (refused, reset): yes. A 502/503/504 not
    from the agent itself (no ``{"error"}`` JSON: a gateway or a restarting pod): yes.
    A 5xx the agent itself answers: only for a GET; a POST's error is the agent's
    considered answer after its own retries (registry, API server), and repeating a
    checkpoint would freeze the server again. A 4xx or a timeout (the call may still be
    running): never.
    """
    if code == 0:
        return True
    if code < 500:
        return False
    if not agent_said:
        return code in (502, 503, 504)
    return method == "GET"


class AgentConnection(LoggingConfigurable):
    """How the hub side reaches the gpusnap node agents, and the one client that calls them.

    Set once as ``c.AgentConnection.…``; the service and the spawner (``SnapKubeSpawner``)
    through :class:`AgentLocator`, and ``jupyterhub-gpusnap doctor``, read the same settings.
    """

    agent_namespace = Unicode(
        AGENT_NAMESPACE,
        help="Namespace of the agent DaemonSet (helm-values/agent/ and the Helm values' "
        "custom.gpusnap.agentNamespace use 'gpusnap-system'). The hub and the service need "
        "'list pods' there.",
    ).tag(config=True)

    agent_label_selector = Unicode(
        "app.kubernetes.io/name=jupyterhub-gpusnap-agent",
        help="Label selector of the agent pods; the one on the server's node is used.",
    ).tag(config=True)

    agent_port = Integer(9780, help="Port of the agents' HTTP API.").tag(config=True)

    agent_scheme = Unicode(
        "http",
        help="'http' (inside the cluster network, protect it with a NetworkPolicy) or 'https'.",
    ).tag(config=True)

    agent_url_template = Unicode(
        "",
        help="Fixed URL of the agent on a node instead of looking its pod up by label, with "
        "``{host_ip}`` (the node's IP) and ``{node}`` (its name), e.g. "
        "``http://{host_ip}:9780`` for an agent on the host network.",
    ).tag(config=True)

    agent_api_token = Unicode(
        help="Shared secret sent to the agents as ``Authorization: Bearer`` (their "
        "auth='token'). Default: the GPUSNAP_AGENT_TOKEN environment variable (Z2JH: put it in "
        "hub.extraEnv from the Secret in helm-values/agent/).",
    ).tag(config=True)

    @default("agent_api_token")
    def _default_agent_api_token(self) -> str:
        return os.environ.get("GPUSNAP_AGENT_TOKEN", "")

    agent_token_file = Unicode(
        "",
        help="File with the agents' shared secret, read on every call; takes precedence over "
        "agent_api_token. With neither set, this pod's ServiceAccount token "
        "(KubeAPI.token_file) is sent, for agents with auth='tokenreview' (add "
        "system:serviceaccount:<ns>:<name> to their allowed_users).",
    ).tag(config=True)

    agent_timeout = Float(
        900.0,
        help="Seconds a call to an agent may take; a checkpoint includes the kubelet's dump and the push.",
    ).tag(config=True)

    api = Instance(KubeAPI)

    backoff = Instance(Backoff)

    @default("backoff")
    def _default_backoff(self) -> Backoff:
        return Backoff(parent=self)

    @default("api")
    def _api(self) -> KubeAPI:
        # API-server calls retry (no answer, 5xx) with the same Backoff as the agent calls
        return KubeAPI(parent=self, backoff=self.backoff)

    def token(self) -> str:
        """The bearer token for the agents: ``agent_token_file``, else ``agent_api_token``,
        else this pod's ServiceAccount token."""
        path = self.agent_token_file or ("" if self.agent_api_token else self.api.token_file)
        if not path:
            return self.agent_api_token
        try:
            return Path(path).read_text().strip()
        except OSError as e:
            raise AgentError(
                f"no token for the node agent ({path}: {e.strerror}): set "
                "AgentConnection.agent_api_token (or the GPUSNAP_AGENT_TOKEN environment "
                "variable) or agent_token_file",
            ) from e

    def url_of(self, agent_pod: dict) -> str:
        """Base URL of the agent API served by ``agent_pod`` (a running agent pod)."""
        status = agent_pod.get("status") or {}
        if self.agent_url_template:
            node = (agent_pod.get("spec") or {}).get("nodeName", "")
            return self.agent_url_template.format(host_ip=status.get("hostIP", ""), node=node)
        ip = status["podIP"]
        return f"{self.agent_scheme}://{'[' + ip + ']' if ':' in ip else ip}:{self.agent_port}"

    async def agent_url(self, node: str, host_ip: str = "") -> str:
        """Base URL of the agent on ``node``: ``agent_url_template`` (with ``host_ip``, else
        the node's InternalIP), else the agent pod found there by label."""
        if self.agent_url_template:
            if not host_ip and "{host_ip}" in self.agent_url_template:
                addresses = ((await self.api.get_node(node)).get("status") or {}).get("addresses")
                host_ip = next(
                    (a["address"] for a in addresses or [] if a.get("type") == "InternalIP"), ""
                )
            return self.agent_url_template.format(host_ip=host_ip, node=node)
        pods = await self.api.list_pods(
            self.agent_namespace,
            label_selector=self.agent_label_selector,
            field_selector=f"spec.nodeName={node}",
        )
        ready = [p for p in pods if (p.get("status") or {}).get("podIP")]
        if not ready:
            raise AgentError(
                f"no gpusnap agent pod runs on node {node} (selector {self.agent_label_selector} in "
                f"namespace {self.agent_namespace})",
                "deploy the agent DaemonSet on GPU nodes (tolerations, nodeSelector) or fix agent_label_selector",
                503,
            )
        return self.url_of(ready[0])

    async def agent_urls(self) -> dict[str, str]:
        """Base URL of the agent on every node that runs one (node name → URL): one list call."""
        pods = await self.api.list_pods(
            self.agent_namespace,
            label_selector=self.agent_label_selector,
            retry=False,  # read every tick (make room): the next tick is the retry
        )
        urls: dict[str, str] = {}
        for pod in pods:
            node = (pod.get("spec") or {}).get("nodeName")
            if node and node not in urls and (pod.get("status") or {}).get("podIP"):
                urls[node] = self.url_of(pod)
        return urls

    async def call(
        self,
        base: str,
        method: str,
        path: str,
        body: dict | None = None,
        timeout: float | None = None,
        retry: bool | None = None,
    ) -> dict:
        """Call an agent; its ``{"error", "fix"}`` answers become AgentError.

        ``retry`` (default: every call but a GET, whose caller reads periodically and
        whose next tick is its retry) tries again with :attr:`backoff` what
        :func:`agent_failure_is_transient` calls a moment's failure.
        """
        if retry is None:
            retry = method != "GET"
        once = lambda: self._call_once(base, method, path, body, timeout)  # noqa: E731
        if not retry:
            return await once()
        return await self.backoff.run(
            once,
            lambda e: getattr(e, "transient", False),
            f"gpusnap agent at {base}: {method} {path}",
        )

    async def _call_once(
        self, base: str, method: str, path: str, body: dict | None, timeout: float | None
    ) -> dict:
        req = HTTPRequest(
            base.rstrip("/") + path,
            method=method,
            headers={
                "Authorization": f"Bearer {self.token()}",
                "Accept": "application/json",
                "Content-Type": "application/json",
            },
            body=json.dumps(body) if body is not None else None,
            request_timeout=timeout or self.agent_timeout,
        )
        try:
            r = await AsyncHTTPClient().fetch(req, raise_error=False)
        except HTTPClientError as e:
            raise AgentError(
                f"the gpusnap agent at {base} did not answer {method} {path}: {e}",
                "check the agent's log; raise agent_timeout for large checkpoints",
                504,
            ) from e
        except OSError as e:
            raise AgentError(
                f"cannot reach the gpusnap node agent at {base}: {e}",
                "check that the agent DaemonSet runs on that node and that the NetworkPolicy "
                "lets the hub side reach the agent port",
                502,
                transient=agent_failure_is_transient(method, 0, False),
            ) from e
        if r.code == 599:
            raise AgentError(
                f"the gpusnap agent at {base} did not answer {method} {path}: {r.error}",
                "check the agent's log; raise agent_timeout for large checkpoints",
                504,
            )
        try:
            data = json.loads(r.body or b"{}")
        except ValueError:
            data = {}
        said = isinstance(data, dict) and bool(data.get("error"))
        if not isinstance(data, dict) or (r.code >= 400 and not said):
            data = {"error": (r.body or b"")[:200].decode(errors="replace"), "fix": ""}
        if r.code >= 400:
            raise AgentError(
                data.get("error") or f"agent answered {r.code}",
                data.get("fix", ""),
                r.code,
                transient=agent_failure_is_transient(method, r.code, said),
            )
        return data


class AgentLocator(AgentConnection):
    """Finds a server's pod and the node agent beside it, and calls the agent's API.

    The hub side's (:class:`~jupyterhub_gpusnap.checkpoint.kubernetes.KubernetesBackend`,
    whose checkpoints the service takes and the spawner restores, and the ``agent``
    signal); the agent settings are :class:`AgentConnection`'s.
    """

    namespace = Unicode(
        help="Namespace of the user pods (KubeSpawner's namespace). Default: $POD_NAMESPACE, else 'default'. "
        "A server's own state (KubeSpawner's 'namespace') wins when present.",
    ).tag(config=True)

    @default("namespace")
    def _default_namespace(self) -> str:
        return os.environ.get("POD_NAMESPACE", "default")

    pod_name_template = Unicode(
        "jupyter-{username}{servername_suffix}",
        help="Pod name of a server when its state has no 'pod_name' (KubeSpawner stores it). "
        "Fields: {username}, {servername}, {servername_suffix} ('--<servername>' for named "
        "servers), all in lowercase [a-z0-9-].",
    ).tag(config=True)

    container = Unicode(
        "notebook", help="Name of the notebook container in the user pod (KubeSpawner: 'notebook')."
    ).tag(config=True)

    def pod_of(self, server: Server) -> tuple[str, str]:
        """(namespace, pod name) of a server."""
        state = server.state or {}
        namespace = state.get("namespace") or self.namespace
        if state.get("pod_name"):
            return namespace, state["pod_name"]
        name = self.pod_name_template.format(
            username=safe_name(server.user),
            servername=safe_name(server.name) if server.name else "",
            servername_suffix=f"--{safe_name(server.name)}" if server.name else "",
        )
        return namespace, name

    async def node_of(self, namespace: str, pod: str) -> str:
        """The node ``namespace/pod`` runs on."""
        return (await self.placement_of(namespace, pod))[0]

    async def placement_of(self, namespace: str, pod: str) -> tuple[str, str]:
        """(node, host IP) of ``namespace/pod``, as its status says (the host IP ``""``
        while unknown); an :class:`AgentError` (409) while it is not scheduled."""
        obj = await self.api.get_pod(namespace, pod)
        node = (obj.get("spec") or {}).get("nodeName")
        if not node:
            raise AgentError(
                f"pod {namespace}/{pod} is not scheduled on a node", "wait until it runs", 409
            )
        return node, (obj.get("status") or {}).get("hostIP", "")
