"""``jupyterhub-gpusnap doctor``: is this Kubernetes cluster ready to suspend GPU servers?

Checks, each with a result and, when it fails, exactly what to fix:

* the API server's Kubernetes version (the kubelet ``ContainerCheckpoint`` gate is beta and
  on by default since 1.30);
* GPU nodes exist and carry the GPU model label that pins a restore to the same model;
* per GPU node: kubelet version, the ``ContainerCheckpoint`` gate (the kubelet's ``/configz``
  through the API server's node proxy, else the agent's own check), the container runtime
  and which restore path it offers, the node agent (CRIU and driver versions, and its own
  node-side checks from ``GET /v1/doctor``);
* where checkpoints go: the OCI registry answers the distribution API, or the PVC is bound;
* RBAC: a SelfSubjectAccessReview for each verb the hub and the service need.

The API server is called with plain REST (the exact paths a reader can try with
``kubectl get --raw``) through :class:`~jupyterhub_gpusnap.kube.api.KubeAPI`; credentials
come from the in-cluster ServiceAccount or a kubeconfig. The node agents are found and
called with the hub's own :class:`~jupyterhub_gpusnap.kube.agent.AgentConnection` settings.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from dataclasses import asdict, dataclass

from tornado.httpclient import AsyncHTTPClient, HTTPClientError
from traitlets import Bool, Enum, Float, Unicode, default
from traitlets.config import Application, LoggingConfigurable

from .kube.agent import AgentConnection
from .kube.api import KubeAPI
from .kube.errors import AgentError

MIN_K8S = (1, 30)  # ContainerCheckpoint beta, on by default
MIN_CRIU = (4, 2)  # 4.1 cannot dump TCP sockets on recent kernels
MIN_DRIVER = 570  # CUDA driver checkpoint API
CONTAINERD_RESTORE = ((2, 1), (2, 3))  # containerd restores checkpoint images only in 2.1-2.3


@dataclass
class Check:
    """One line of the doctor's table.

    ``status`` is ``ok``, ``warn`` (works, with a limitation worth knowing) or ``fail``
    (suspension will not work until ``fix`` is done).
    """

    name: str
    status: str
    detail: str
    fix: str = ""

    @property
    def ok(self) -> bool:
        return self.status != "fail"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """``"v1.33.4"``, ``"cri-o://1.33.2"``, ``"580.159.04"`` → ``(1, 33, 4)`` … (None if no digits)."""
    if not text:
        return None
    m = re.search(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", text)
    if not m:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


def runtime_check(runtime_version: str, restore_mode: str) -> Check:
    """What ``node.status.nodeInfo.containerRuntimeVersion`` means for checkpoint and restore."""
    name, _, version = runtime_version.partition("://")
    v = parse_version(version) or (0,)
    if name == "cri-o":
        if v < (1, 25):
            return Check(
                "container-runtime",
                "fail",
                f"CRI-O {version} cannot checkpoint containers",
                "upgrade CRI-O to >= 1.25 and set enable_criu_support = true in crio.conf",
            )
        return Check(
            "container-runtime",
            "ok",
            f"CRI-O {version}: checkpoints, and restores checkpoint images (restore_mode 'runtime' "
            "for CPU-only servers; GPU servers restore through the agent). Needs "
            "enable_criu_support = true in crio.conf",
        )
    if name == "containerd":
        if v < (1, 7):
            return Check(
                "container-runtime",
                "fail",
                f"containerd {version} cannot checkpoint containers through the CRI",
                "upgrade containerd to >= 2.0 (restore of checkpoint images: 2.1-2.3)",
            )
        low, high = CONTAINERD_RESTORE
        if low <= v[:2] <= high:
            return Check(
                "container-runtime",
                "ok",
                f"containerd {version}: checkpoints, and restores checkpoint images (CPU-only); "
                "GPU servers restore through the agent",
            )
        detail = f"containerd {version}: checkpoints; no runtime restore path, restores go through the node agent"
        if restore_mode == "runtime":
            return Check(
                "container-runtime",
                "fail",
                detail,
                "set c.SnapKubeSpawner.restore_mode = 'agent' (containerd restores checkpoint images only in 2.1-2.3)",
            )
        return Check("container-runtime", "ok", detail)
    return Check(
        "container-runtime",
        "fail",
        f"runtime {runtime_version!r} has no CRI checkpoint support",
        "run GPU notebook nodes on CRI-O (>= 1.25) or containerd (>= 2.0)",
    )


#: (verb, group, resource, subresource, scope, who needs it); scope: "ns" (the
#: notebook namespace), "agent" (the agent namespace) or "" (cluster)
RBAC_NEEDS: list[tuple[str, str, str, str, str, str]] = [
    ("create", "", "pods", "", "ns", "hub (KubeSpawner) creates server and placeholder pods"),
    ("get", "", "pods", "", "ns", "hub and service read pods"),
    ("list", "", "pods", "", "ns", "hub (KubeSpawner) lists pods"),
    ("watch", "", "pods", "", "ns", "hub (KubeSpawner) watches pods"),
    ("delete", "", "pods", "", "ns", "hub deletes the pod of a suspended server"),
    ("list", "", "events", "", "ns", "hub shows pod events as spawn progress"),
    ("create", "", "configmaps", "", "ns", "service records verified checkpoints"),
    ("list", "", "configmaps", "", "ns", "service and hub find a server's checkpoint"),
    ("delete", "", "configmaps", "", "ns", "service applies checkpoint retention"),
    ("list", "", "pods", "", "agent", "hub and service find the node agent on a node"),
    ("get", "", "nodes", "", "", "hub reads the GPU model of a suspended server's node"),
    ("list", "", "nodes", "", "", "doctor lists the GPU nodes"),
]

#: What Zero to JupyterHub's own hub Role grants in the release namespace
#: (``rbac.create: true``): RBAC_NEEDS covered by it are not granted again by
#: helm-values/agent/rbac-hub.yaml, which grants exactly the rest.
CHART_HUB_ROLE: dict[tuple[str, str], set[str]] = {
    ("", "pods"): {"get", "watch", "list", "create", "delete"},
    ("", "persistentvolumeclaims"): {"get", "watch", "list", "create", "delete"},
    ("", "secrets"): {"get", "watch", "list", "create", "delete"},
    ("", "services"): {"get", "watch", "list", "create", "delete"},
    ("", "events"): {"get", "watch", "list"},
}


def granted_by_chart(verb: str, group: str, resource: str, scope: str) -> bool:
    """Whether the Z2JH chart's hub Role already grants this need (namespace scope only)."""
    return scope == "ns" and verb in CHART_HUB_ROLE.get((group, resource), set())


class Doctor(LoggingConfigurable):
    """Runs the readiness checks of a cluster; see :meth:`run`."""

    namespace = Unicode(
        "",
        help="Namespace of the notebook pods (Z2JH: the release namespace). "
        "Default: the in-cluster namespace, else 'default'.",
    ).tag(config=True)

    @default("namespace")
    def _default_namespace(self) -> str:
        try:
            with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
                return f.read().strip()
        except OSError:
            return "default"

    kubeconfig = Unicode(
        "",
        help="kubeconfig file to use outside the cluster (default: $KUBECONFIG or ~/.kube/config). "
        "Inside a pod the ServiceAccount is used.",
    ).tag(config=True)

    gpu_resource_name = Unicode(
        "nvidia.com/gpu", help="Extended resource that marks a GPU node (allocatable > 0)."
    ).tag(config=True)

    gpu_product_label = Unicode(
        "nvidia.com/gpu.product",
        help="Node label with the GPU model, used to pin a restore to the same model.",
    ).tag(config=True)

    restore_mode = Enum(
        ["agent", "runtime"],
        default_value="agent",
        help="The restore mode you configured on SnapKubeSpawner; a runtime without a restore path fails only with 'runtime'.",
    ).tag(config=True)

    agent_timeout = Float(10, help="Seconds to wait for each node agent answer.").tag(config=True)

    registry = Unicode(
        "",
        help="Registry repository prefix for checkpoint images, e.g. 'registry.example.org/gpusnap' "
        "(checked with GET /v2/). Leave empty when checkpoints go to a PVC.",
    ).tag(config=True)

    registry_insecure = Bool(
        False, help="Talk plain HTTP to the registry (an in-cluster registry without TLS)."
    ).tag(config=True)

    pvc = Unicode(
        "",
        help="Name of the PVC (in `namespace`) holding checkpoints, when not using a registry.",
    ).tag(config=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._api: KubeAPI | None = None
        self.agents: AgentConnection | None = None

    async def _client(self) -> KubeAPI:
        if self._api is None:
            self._api = await KubeAPI.from_kubeconfig(self.kubeconfig, parent=self)
            # the node agents as the hub reaches them (c.AgentConnection), looked up with
            # doctor's credentials
            self.agents = AgentConnection(parent=self, api=self._api)
        return self._api

    async def run(self) -> list[Check]:
        """Run every check and return them in table order."""
        try:
            kube = await self._client()
        except Exception as e:
            return [
                Check(
                    "kubernetes-api",
                    "fail",
                    f"no credentials for the API server: {e}",
                    "run inside the hub pod, or pass --kubeconfig",
                )
            ]
        checks: list[Check] = []
        version_check, server_version = await self._check_version(kube)
        checks.append(version_check)
        if version_check.name == "kubernetes-api":
            return checks
        checks += await self._check_nodes(kube, server_version)
        checks += await self._check_storage(kube)
        checks += await self._check_rbac(kube)
        return checks

    async def _check_version(self, kube: KubeAPI) -> tuple[Check, tuple[int, ...] | None]:
        code, data = await kube.answer("GET", "/version")
        if code != 200:
            return (
                Check(
                    "kubernetes-api",
                    "fail",
                    f"GET /version: {code} {data.get('message', '')}".strip(),
                    "check the API server address and credentials (kubeconfig or ServiceAccount)",
                ),
                None,
            )
        git = data.get("gitVersion", "")
        v = parse_version(git)
        if v is None or v[:2] < MIN_K8S:
            return (
                Check(
                    "kubernetes-version",
                    "fail",
                    f"API server {git}: the ContainerCheckpoint feature is alpha/off before 1.30",
                    "upgrade to Kubernetes >= 1.30, or enable the ContainerCheckpoint feature gate on "
                    "the API server and every kubelet (--feature-gates=ContainerCheckpoint=true)",
                ),
                v,
            )
        return Check("kubernetes-version", "ok", f"API server {git}"), v

    async def _check_nodes(self, kube: KubeAPI, server_version) -> list[Check]:
        code, data = await kube.answer("GET", "/api/v1/nodes")
        if code != 200:
            return [
                Check(
                    "gpu-nodes",
                    "fail",
                    f"GET /api/v1/nodes: {code} {data.get('message', '')}",
                    "grant 'list' on 'nodes' (ClusterRole) to the hub/service ServiceAccount",
                )
            ]
        gpu_nodes = [
            n
            for n in data.get("items", [])
            if int(
                (n.get("status", {}).get("allocatable") or {}).get(self.gpu_resource_name, "0") or 0
            )
            > 0
        ]
        if not gpu_nodes:
            return [
                Check(
                    "gpu-nodes",
                    "fail",
                    f"no node has allocatable {self.gpu_resource_name}",
                    "install the NVIDIA GPU Operator (device plugin + GPU feature discovery) on the GPU nodes",
                )
            ]
        names = ", ".join(n["metadata"]["name"] for n in gpu_nodes)
        checks = [Check("gpu-nodes", "ok", f"{len(gpu_nodes)} GPU node(s): {names}")]
        results = await asyncio.gather(*(self._check_node(kube, n) for n in gpu_nodes))
        for r in results:
            checks += r
        return checks

    async def _check_node(self, kube: KubeAPI, node: dict) -> list[Check]:
        name = node["metadata"]["name"]
        labels = node["metadata"].get("labels") or {}
        info = node.get("status", {}).get("nodeInfo") or {}
        out: list[Check] = []

        add = out.append

        product = labels.get(self.gpu_product_label)
        count = (node["status"].get("allocatable") or {}).get(self.gpu_resource_name)
        if product:
            add(Check("gpu-model", "ok", f"{count} × {product}"))
        else:
            add(
                Check(
                    "gpu-model",
                    "fail",
                    f"no {self.gpu_product_label} label: a restore cannot be pinned to the same GPU model",
                    "deploy NVIDIA GPU feature discovery (part of the GPU Operator), or label the node: "
                    f"kubectl label node {name} {self.gpu_product_label}=<model>",
                )
            )

        kubelet = info.get("kubeletVersion", "")
        kv = parse_version(kubelet)
        if kv is None or kv[:2] < MIN_K8S:
            add(
                Check(
                    "kubelet-version",
                    "fail",
                    f"kubelet {kubelet or 'unknown'}",
                    "upgrade the kubelet to >= 1.30 (ContainerCheckpoint on by default)",
                )
            )
        else:
            add(Check("kubelet-version", "ok", f"kubelet {kubelet}"))

        add(runtime_check(info.get("containerRuntimeVersion", ""), self.restore_mode))

        agent_checks = await self._agent_checks(kube, node)
        gate = await self._gate_check(kube, name, kv, agent_checks)
        add(gate)
        for c in agent_checks:
            if c.name != "kubelet-checkpoint-gate":  # folded into the gate check above
                add(c)
        return [Check(f"{name}: {c.name}", c.status, c.detail, c.fix) for c in out]

    async def _gate_check(self, kube: KubeAPI, node: str, kubelet_version, agent_checks) -> Check:
        code, data = await kube.answer("GET", f"/api/v1/nodes/{node}/proxy/configz")
        if code == 200:
            gates = (data.get("kubeletconfig") or {}).get("featureGates") or {}
            enabled = gates.get("ContainerCheckpoint")
            if enabled is None:
                enabled = kubelet_version is not None and kubelet_version[:2] >= MIN_K8S
            if enabled:
                return Check(
                    "kubelet-checkpoint-gate",
                    "ok",
                    "ContainerCheckpoint enabled (kubelet /configz)",
                )
            return Check(
                "kubelet-checkpoint-gate",
                "fail",
                "ContainerCheckpoint is disabled in the kubelet configuration",
                "set featureGates: {ContainerCheckpoint: true} in the kubelet config "
                "(/var/lib/kubelet/config.yaml) and restart the kubelet",
            )
        from_agent = next((c for c in agent_checks if c.name == "kubelet-checkpoint-gate"), None)
        if from_agent is not None:
            from_agent.detail = f"via the node agent: {from_agent.detail}"
            return from_agent
        return Check(
            "kubelet-checkpoint-gate",
            "warn",
            f"could not read the kubelet's /configz ({code}: {data.get('message', '')[:120]}) "
            "and the node agent did not report it",
            "deploy the node agent (it checks the gate locally), or run doctor with a kubeconfig "
            "allowed 'get nodes/proxy' (an admin's)",
        )

    async def _agent_url(self, node: dict) -> str:
        name = node["metadata"]["name"]
        addresses = node.get("status", {}).get("addresses") or []
        host_ip = next((a["address"] for a in addresses if a.get("type") == "InternalIP"), "")
        try:
            return await self.agents.agent_url(name, host_ip)
        except AgentError as e:
            if e.code != 503:
                raise
            raise AgentError(
                f"no node agent pod on {name} (selector {self.agents.agent_label_selector} in "
                f"namespace {self.agents.agent_namespace})",
                code=503,
            ) from e

    async def _agent_checks(self, kube: KubeAPI, node: dict) -> list[Check]:
        try:
            url = await self._agent_url(node)
            health = await self.agents.call(url, "GET", "/healthz", timeout=self.agent_timeout)
        except AgentError as e:
            fix = (
                "deploy the agent DaemonSet (kubectl apply -f helm-values/agent/) on GPU nodes "
                "(its nodeSelector and tolerations must match them), allow the hub egress to its "
                "port, and give both sides the same token"
            )
            if e.code == 401 or "bad token" in str(e) or "401" in str(e):
                fix = "give doctor and the hub the agent's token (GPUSNAP_AGENT_TOKEN from the agent Secret)"
            return [Check("node-agent", "fail", str(e), fix)]
        checks = [Check("node-agent", "ok", f"answering at {url}")]
        criu = health.get("criu")
        cv = parse_version(criu)
        if cv is None:
            checks.append(
                Check(
                    "criu",
                    "fail",
                    "CRIU not found by the agent",
                    "install CRIU >= 4.2 in the agent image (helm-values/Dockerfile.agent) or on the node",
                )
            )
        elif cv[:2] < MIN_CRIU:
            checks.append(
                Check(
                    "criu",
                    "fail",
                    f"CRIU {criu}: older than 4.2 (4.1 cannot dump TCP sockets on recent kernels)",
                    "install CRIU >= 4.2 (helm-values/Dockerfile.agent builds it)",
                )
            )
        else:
            checks.append(Check("criu", "ok", f"CRIU {criu}"))
        driver = health.get("driver")
        dv = parse_version(driver)
        if dv is None:
            checks.append(
                Check(
                    "nvidia-driver",
                    "fail",
                    "the agent found no NVIDIA driver (NVML)",
                    "mount the driver into the agent (hostPath /run/nvidia/driver or /usr/lib/x86_64-linux-gnu) "
                    "and check the GPU Operator's driver pods",
                )
            )
        elif dv[0] < MIN_DRIVER:
            checks.append(
                Check(
                    "nvidia-driver",
                    "fail",
                    f"driver {driver}: no CUDA checkpoint API",
                    f"upgrade the NVIDIA driver to >= {MIN_DRIVER}",
                )
            )
        else:
            checks.append(Check("nvidia-driver", "ok", f"driver {driver}"))
        try:
            node_side = await self.agents.call(url, "GET", "/v1/doctor", timeout=self.agent_timeout)
        except AgentError as e:
            checks.append(
                Check(
                    "agent-doctor", "fail", str(e), "upgrade the agent to a version with /v1/doctor"
                )
            )
            return checks
        by_name = {c.name: i for i, c in enumerate(checks)}
        for c in node_side.get("checks", []):
            ok = c.get("ok")
            check = Check(
                str(c.get("name", "agent-check")),
                "ok" if ok else "fail",
                str(c.get("detail", "")),
                "" if ok else str(c.get("fix", "")),
            )
            if check.name in by_name:
                # the agent's own check of the same fact (criu, nvidia-driver): a failure
                # there is more specific than the version read from /healthz
                if not check.ok:
                    checks[by_name[check.name]] = check
                continue
            checks.append(check)
        return checks

    async def _check_storage(self, kube: KubeAPI) -> list[Check]:
        checks: list[Check] = []
        if self.registry:
            host = self.registry.split("/", 1)[0]
            url = f"{'http' if self.registry_insecure else 'https'}://{host}/v2/"
            try:
                resp = await AsyncHTTPClient().fetch(url, raise_error=False, request_timeout=10)
                code = resp.code
                why = resp.reason
            except (OSError, HTTPClientError) as e:
                code, why = 0, str(e)
            if code in (200, 401):
                checks.append(
                    Check("registry", "ok", f"{url} answers the distribution API ({code})")
                )
            else:
                checks.append(
                    Check(
                        "registry",
                        "fail",
                        f"{url}: {code or 'no answer'} {why}",
                        "check the registry address and that nodes and the hub can reach it "
                        "(NetworkPolicy egress, TLS: set registry_insecure for a plain-HTTP in-cluster registry)",
                    )
                )
        if self.pvc:
            code, data = await kube.answer(
                "GET", f"/api/v1/namespaces/{self.namespace}/persistentvolumeclaims/{self.pvc}"
            )
            phase = (data.get("status") or {}).get("phase") if code == 200 else None
            if code == 200 and phase == "Bound":
                checks.append(Check("pvc", "ok", f"{self.namespace}/{self.pvc} is Bound"))
            elif code == 200:
                checks.append(
                    Check(
                        "pvc",
                        "fail",
                        f"{self.namespace}/{self.pvc} is {phase}",
                        "bind it: check its StorageClass; it must be ReadWriteMany to be mounted by agents on every GPU node",
                    )
                )
            else:
                checks.append(
                    Check(
                        "pvc",
                        "fail",
                        f"{self.namespace}/{self.pvc}: {code} {data.get('message', '')}",
                        f"create the PVC {self.pvc} in namespace {self.namespace} (ReadWriteMany)",
                    )
                )
        if not self.registry and not self.pvc:
            checks.append(
                Check(
                    "checkpoint-storage",
                    "fail",
                    "neither a registry nor a PVC is configured for checkpoints",
                    "pass --registry=registry.example.org/gpusnap or --pvc=gpusnap-snapshots "
                    "(the same as custom.gpusnap in the Helm values)",
                )
            )
        return checks

    async def _check_rbac(self, kube: KubeAPI) -> list[Check]:
        async def review(need) -> Check:
            verb, group, resource, sub, scope, why = need
            namespace = {"ns": self.namespace, "agent": self.agents.agent_namespace}.get(scope, "")
            namespaced = bool(namespace)
            attrs = {"verb": verb, "resource": resource}
            if group:
                attrs["group"] = group
            if sub:
                attrs["subresource"] = sub
            if namespaced:
                attrs["namespace"] = namespace
            body = {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SelfSubjectAccessReview",
                "spec": {"resourceAttributes": attrs},
            }
            code, data = await kube.answer(
                "POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", body
            )
            what = f"{verb} {resource}{'/' + sub if sub else ''}" + (
                f" in {namespace}" if namespaced else " (cluster)"
            )
            if code in (200, 201) and (data.get("status") or {}).get("allowed"):
                return Check(f"rbac: {what}", "ok", why)
            kind = f"Role in {namespace}" if namespaced else "ClusterRole"
            return Check(
                f"rbac: {what}",
                "fail",
                f"not allowed ({why})"
                if code in (200, 201)
                else f"review failed: {code} {data.get('message', '')}",
                f"the Zero to JupyterHub chart's hub Role grants {verb} {resource} in "
                f"{namespace}: keep rbac.create: true in the chart values"
                if granted_by_chart(verb, group, resource, scope)
                else f"add verbs [{verb}] on {resource}{'/' + sub if sub else ''} to the hub's "
                f"{kind} (helm-values/agent/rbac-hub.yaml)",
            )

        return list(await asyncio.gather(*(review(n) for n in RBAC_NEEDS)))


def format_table(checks: list[Check]) -> str:
    """A plain-text table: CHECK | RESULT | DETAIL, with the fix under each failure."""
    width = max([len("CHECK")] + [len(c.name) for c in checks])
    lines = [f"{'CHECK'.ljust(width)}  RESULT  DETAIL"]
    for c in checks:
        lines.append(f"{c.name.ljust(width)}  {c.status.upper().ljust(6)}  {c.detail}")
        if c.fix and c.status != "ok":
            lines.append(f"{''.ljust(width)}  {''.ljust(6)}  fix: {c.fix}")
    failed = sum(1 for c in checks if c.status == "fail")
    lines.append("")
    lines.append(
        "ready: every check passed"
        if not failed
        else f"not ready: {failed} check(s) failed; fix them and run doctor again"
    )
    return "\n".join(lines)


async def doctor(**config) -> list[Check]:
    """Run the checks with ``config`` as :class:`Doctor` traits; return them."""
    return await Doctor(**config).run()


class DoctorApp(Application):
    """``jupyterhub-gpusnap doctor``: check a Kubernetes cluster's readiness and say what to fix."""

    name = "jupyterhub-gpusnap-doctor"
    description = __doc__.split("\n\n")[0] if __doc__ else ""
    classes = [Doctor, AgentConnection]

    aliases = {
        "namespace": "Doctor.namespace",
        "kubeconfig": "Doctor.kubeconfig",
        "registry": "Doctor.registry",
        "pvc": "Doctor.pvc",
        "restore-mode": "Doctor.restore_mode",
        "agent-namespace": "AgentConnection.agent_namespace",
        "agent-port": "AgentConnection.agent_port",
        "agent-url": "AgentConnection.agent_url_template",
        "agent-token": "AgentConnection.agent_api_token",
        "agent-token-file": "AgentConnection.agent_token_file",
        "config": "DoctorApp.config_file",
        "log-level": "Application.log_level",
    }
    flags = {
        "json": ({"DoctorApp": {"output_json": True}}, "Print the checks as JSON."),
        "registry-insecure": (
            {"Doctor": {"registry_insecure": True}},
            "Plain HTTP to the registry.",
        ),
    }

    output_json = Bool(False, help="Print the checks as JSON instead of a table.").tag(config=True)
    config_file = Unicode(
        "", help="Python config file to load (c.Doctor.…, c.AgentConnection.…)."
    ).tag(config=True)

    checks: list[Check] = []

    def initialize(self, argv=None):
        super().initialize(argv)
        if self.config_file:
            self.load_config_file(self.config_file)

    async def run(self) -> int:
        """Run the checks, print them; return the exit status (1 if any failed)."""
        self.checks = await Doctor(parent=self).run()
        if self.output_json:
            print(json.dumps({"checks": [c.as_dict() for c in self.checks]}, indent=2))
        else:
            print(format_table(self.checks))
        return 0 if all(c.ok for c in self.checks) else 1

    def start(self) -> None:
        sys.exit(asyncio.run(self.run()))


main = DoctorApp.launch_instance

if __name__ == "__main__":
    main()
