"""A wire-level fake of the Kubernetes API server and a kubelet, for tests on a machine with no cluster.

Both are real tornado HTTP servers answering the exact paths and JSON shapes the real
ones use; every Pod, PodList, Node, ConfigMap, TokenReview and Status they return is
validated against the Kubernetes 1.37 OpenAPI schemas (kubernetes-validate, strict).

API server: ``GET /api/v1/namespaces/{ns}/pods/{pod}``, ``DELETE`` of the same,
``GET /api/v1/pods`` and ``/api/v1/namespaces/{ns}/pods`` with ``labelSelector`` and
``fieldSelector``, ``GET /api/v1/nodes/{node}``, ConfigMaps (create, get, list, delete),
``POST /apis/authentication.k8s.io/v1/tokenreviews`` and the node proxy
``POST /api/v1/nodes/{node}/proxy/checkpoint/...``. Unknown tokens get 401, denied
resources a 403 ``Status`` (``forbid("nodes/proxy")``).

Kubelet: ``POST /checkpoint/{ns}/{pod}/{container}?timeout=`` has the real container
runtime checkpoint the pod's real container (a runc container, see oci_runtime.py:
``runc checkpoint --leave-running`` under CRIU, the container keeps running, and the
archive CRI-O writes: ``checkpoint/ config.dump spec.dump bind.mounts rootfs-diff.tar
deleted.files dump.log stats-dump``) into a folder standing for
``/var/lib/kubelet/checkpoints`` and answers ``{"items": ["/var/lib/kubelet/checkpoints/…tar"]}``.
It invents nothing: it is only the kubelet's HTTP front.
``kubelet_mode`` switches it to a failure: ``gate-off`` (404, as with the
ContainerCheckpoint gate off or an unparsable timeout), ``error`` (500 from the
runtime), ``hang`` (no answer), ``forbidden`` (403 for ``nodes/checkpoint``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import io
import json
import re
import shutil
import tarfile
import tempfile
import time
import uuid
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import referencing
from tornado import web
from tornado.httpserver import HTTPServer
from tornado.iostream import StreamClosedError

from jupyterhub_gpusnap.agent.pods import container_id

from .oci_runtime import RUNC_ROOT
from .ports import free_port

CRIU = shutil.which("criu") or "/usr/local/sbin/criu"
KUBELET_DIR = "/var/lib/kubelet/checkpoints"
SCHEMA_DIR = (
    Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / "v1.37.0-local-strict"
)
SCHEMA_FILES = {
    "Pod": "pod-v1.json",
    "PodList": "podlist-v1.json",
    "Node": "node-v1.json",
    "Status": "status-meta-v1.json",
    "ConfigMap": "configmap-v1.json",
    "ConfigMapList": "configmaplist-v1.json",
    "TokenReview": "tokenreview-authentication-v1.json",
    "SelfSubjectAccessReview": "selfsubjectaccessreview-authorization-v1.json",
    "NodeList": "nodelist-v1.json",
    "EventList": "eventlist-v1.json",
    "PersistentVolumeClaim": "persistentvolumeclaim-v1.json",
}


@cache
def _validator(kind: str) -> jsonschema.Validator:
    schema = json.loads((SCHEMA_DIR / SCHEMA_FILES[kind]).read_text())
    defs = json.loads((SCHEMA_DIR / "_definitions.json").read_text())
    registry = referencing.Resource.from_contents(schema) @ referencing.Registry()
    registry = referencing.Resource.from_contents(defs) @ registry
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


def validate(obj: dict) -> dict:
    """Raise jsonschema.ValidationError unless ``obj`` matches its kind's Kubernetes schema."""
    _validator(obj["kind"]).validate(obj)
    return obj


def rfc3339(t: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if t is None else t))


def status(code: int, reason: str, message: str, details: dict | None = None) -> dict:
    """A Kubernetes ``Status`` failure body, as the API server sends it."""
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        body["details"] = details
    return validate(body)


def match_labels(labels: dict, selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.split("=", 1)
            if labels.get(k.rstrip("=")) != v:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def match_fields(obj: dict, selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        k, v = term.split("=", 1)
        value = obj
        for part in k.split("."):
            value = (value or {}).get(part)
        if (value or "") != v:
            return False
    return True


# -- the containers of pods --------------------------------------------------------------

WORKLOAD = r"""
import os, sys, time
secret = os.urandom(8).hex()
ballast = os.urandom(int(sys.argv[2]))
n = 0
while True:
    n += 1
    with open(sys.argv[1], "a") as f:
        f.write(f"{secret} {n}\n")
    time.sleep(0.05)
"""


class Workload:
    """A real runc container (:class:`oci_runtime.Container`, in a pod sandbox of its own)
    standing for a notebook container: its process keeps a random secret in memory and
    appends ``<secret> <counter>`` every 50 ms to a log on its volume (``volume``, mounted
    at /home/jovyan), so a restored copy is recognisable (same secret, counter going on)
    and a fresh one is not. A pod added with it (``add_pod(workload=…)``) runs that
    container, and the fake kubelet checkpoints it through the runtime."""

    def __init__(self, folder: Path, ballast: int = 1 << 20):
        self.folder = Path(folder)
        self.volume = self.folder / "workload-volume"
        self.log = self.volume / "workload.log"
        self.ballast = ballast
        self.container = None

    def start(self) -> Workload:
        from . import oci_runtime

        why = oci_runtime.missing()
        assert not why, why
        self.volume.mkdir(parents=True, exist_ok=True)
        self.container = oci_runtime.Container(
            self.folder / "pods",
            oci_runtime.PodSandbox.new(),
            ["python3", "-S", "-c", WORKLOAD, "/home/jovyan/workload.log", str(self.ballast)],
            home=self.volume,
        ).start()
        return self

    @property
    def pid(self) -> int:
        return self.container.pid if self.container is not None else 0

    def placeholder(self):
        """A placeholder container for this workload's pod: same image and volume,
        ``sleep infinity``, a pod sandbox of its own (stopped with :meth:`stop`)."""
        from . import oci_runtime

        box = oci_runtime.Container(
            self.folder / "pods",
            oci_runtime.PodSandbox.new(),
            ["sleep", "infinity"],
            home=self.volume,
        ).start()
        self._placeholders = [*getattr(self, "_placeholders", []), box]
        return box

    def lines(self) -> list[tuple[str, int]]:
        if not self.log.exists():
            return []
        out = []
        for line in self.log.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                out.append((parts[0], int(parts[1])))
        return out

    async def wait_lines(self, count: int, timeout: float = 10.0) -> list[tuple[str, int]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.lines()
            if len(lines) >= count:
                return lines
            await asyncio.sleep(0.02)
        raise AssertionError(f"workload log has {len(self.lines())} lines, wanted {count}")

    def alive(self) -> bool:
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return False
        return self.pid > 0 and stat.rpartition(")")[2].split()[0] != "Z"

    def stop(self) -> None:
        """Delete the pod: every process of its container killed, its sandbox gone."""
        if self.container is not None:
            self.container.delete()
            self.container.sandbox.stop()

    def close(self) -> None:
        """Delete the pod and the placeholders made for it."""
        self.stop()
        for box in getattr(self, "_placeholders", []):
            box.delete()
            box.sandbox.stop()
        self._placeholders = []


def cgroup2_mount() -> Path:
    """Where this machine's cgroup v2 (unified) hierarchy is mounted."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[0] == "cgroup2":
            return Path(left.split()[4])
    raise AssertionError("no cgroup2 mount on this machine")


class NodeTree:
    """A node's /proc and cgroup v2 tree under a folder, in the kernel's formats.

    Real files with real contents (``/proc/<pid>/cgroup`` lines, ``cpu.stat``) for
    host PIDs that need not exist here; what the agent's PodMapper reads on a node.
    """

    def __init__(self, root: Path):
        self.proc = Path(root) / "proc"
        self.cgroup = Path(root) / "cgroup"
        self.proc.mkdir(parents=True, exist_ok=True)
        self.cgroup.mkdir(parents=True, exist_ok=True)
        (self.cgroup / "cgroup.controllers").write_text(
            "cpuset cpu io memory hugetlb pids rdma misc\n"
        )
        # processes outside any pod: the node's init and a system daemon
        self.add_process(1, "/init.scope")
        self.add_process(812, "/system.slice/containerd.service")

    def pod_cgroup(self, uid: str, qos: str = "burstable") -> str:
        return (
            f"/kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{uid.replace('-', '_')}.slice"
        )

    def add_process(self, pid: int, cgroup_path: str) -> None:
        d = self.proc / str(pid)
        d.mkdir(exist_ok=True)
        (d / "cgroup").write_text(f"0::{cgroup_path}\n")
        (d / "stat").write_text(
            f"{pid} (python3) S 1 {pid} {pid} 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 100 0 0\n"
        )

    def add_pod_process(self, pid: int, uid: str, container_id: str, usage_usec: int = 0) -> None:
        pod = self.pod_cgroup(uid)
        self.add_process(pid, f"{pod}/cri-containerd-{container_id}.scope")
        (self.cgroup / pod.lstrip("/")).mkdir(parents=True, exist_ok=True)
        if not (self.cgroup / pod.lstrip("/") / "cpu.stat").exists():
            self.set_cpu(uid, usage_usec)

    def set_cpu(self, uid: str, usage_usec: int) -> None:
        path = self.cgroup / self.pod_cgroup(uid).lstrip("/") / "cpu.stat"
        path.write_text(
            f"usage_usec {usage_usec}\nuser_usec {usage_usec * 3 // 4}\nsystem_usec {usage_usec // 4}\n"
            "core_sched.force_idle_usec 0\nnr_periods 0\nnr_throttled 0\nthrottled_usec 0\n"
            "nr_bursts 0\nburst_usec 0\n"
        )


# -- the fake cluster ------------------------------------------------------------------

#: Kubernetes version the hub-side objects (pods KubeSpawner creates, nodes) are checked
#: against with kubernetes_validate, as KubeSpawner's users run it.
K8S_VERSION = "1.33"
H100 = "NVIDIA-H100-80GB-HBM3"
A100 = "NVIDIA-A100-SXM4-80GB"
#: The bearer token of the hub's ServiceAccount in kubeconfigs written by FakeKube.kubeconfig.
HUB_TOKEN = "kube-token"
HUB_USER = "system:serviceaccount:jhub:hub"


def make_node(
    name: str,
    gpu_product: str | None = None,
    gpus: int = 0,
    runtime: str = "cri-o://1.33.2",
    kubelet: str = "v1.33.4",
    ip: str = "127.0.0.1",
    kubelet_port: int = 10250,
) -> dict:
    """A Node as the API server returns it; GPU nodes carry GPU feature discovery labels."""
    labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}
    capacity = {"cpu": "16", "memory": "128Gi", "pods": "110"}
    if gpus:
        labels["nvidia.com/gpu.present"] = "true"
        labels["nvidia.com/gpu.count"] = str(gpus)
        capacity["nvidia.com/gpu"] = str(gpus)
    if gpu_product:
        labels["nvidia.com/gpu.product"] = gpu_product
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "uid": str(uuid.uuid4()),
            "labels": labels,
            "resourceVersion": "1",
            "creationTimestamp": rfc3339(),
        },
        "spec": {},
        "status": {
            "capacity": capacity,
            "allocatable": dict(capacity),
            "addresses": [
                {"type": "InternalIP", "address": ip},
                {"type": "Hostname", "address": name},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
            "nodeInfo": {
                "architecture": "amd64",
                "bootID": str(uuid.uuid4()),
                "containerRuntimeVersion": runtime,
                "kernelVersion": "6.18.0",
                "kubeProxyVersion": "",
                "kubeletVersion": kubelet,
                "machineID": uuid.uuid4().hex,
                "operatingSystem": "linux",
                "osImage": "Ubuntu 24.04",
                "systemUUID": str(uuid.uuid4()),
            },
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "kubelet is posting ready status",
                    "lastHeartbeatTime": rfc3339(),
                    "lastTransitionTime": rfc3339(),
                }
            ],
        },
    }
    kubernetes_validate.validate(node, K8S_VERSION, strict=True)
    return validate(node)


def term_matches(term: dict, labels: dict) -> bool:
    """One nodeSelectorTerm (its matchExpressions ANDed) against a node's labels."""
    for expr in term.get("matchExpressions") or []:
        op, key, values = expr["operator"], expr["key"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
    return True


class FakeKube:
    """The API server, the scheduler's and kubelets' pod lifecycle, and one kubelet
    checkpoint endpoint, all on localhost.

    - ``pods``/``configmaps``: ``(namespace, name)`` → object; ``nodes``: name → Node;
      ``pvcs``: ``"ns/name"`` → PersistentVolumeClaim.
    - Pods created through the API (KubeSpawner) are validated, then "scheduled" after
      50 ms honouring nodeSelector, required node affinity and GPU capacity (a pod no
      node fits stays Pending, Unschedulable), and watchers get ADDED/MODIFIED/DELETED
      events. A DELETE is graceful: ``deletionTimestamp`` first, gone 50 ms later.
    - Auth: a bearer token must be one of ``tokens`` (``add_token``; ``kubeconfig()``
      registers the hub's); RBAC: requests on a resource in ``forbidden`` get a 403
      ``Status``; SelfSubjectAccessReviews (and the node proxy's ``/configz``) answer from
      ``allowed`` (``(verb, group, resource, subresource)``), minus anything forbidden.
    - ``requests``: ``(method, uri, JSON body or None)`` of every API server and kubelet call.
    """

    def __init__(self, root: Path | None = None, version: str = "v1.33.4", kubelet_ssl=None):
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="kube-"))
        self.version = version
        self.kubelet_ssl = kubelet_ssl  # an ssl.SSLContext: the kubelet serves https
        self.checkpoints = self.root / "kubelet-checkpoints"  # /var/lib/kubelet/checkpoints
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        self.pods: dict[tuple[str, str], dict] = {}
        self.nodes: dict[str, dict] = {}
        self.configmaps: dict[tuple[str, str], dict] = {}
        self.pvcs: dict[str, dict] = {}
        self.configz: dict[str, dict] = {}  # node -> kubeletconfig served at /configz
        self.workloads: dict[tuple[str, str], Workload] = {}
        self.containers: dict[tuple[str, str], object] = {}  # real runc containers of pods
        self.archives: list[list[str]] = []  # member names of every archive the kubelet wrote
        self.tokens: dict[str, str] = {}  # bearer token -> username
        self.forbidden: set[str] = set()  # resources (e.g. "nodes/checkpoint") RBAC denies
        self.allowed: set[tuple[str, str, str, str]] = set()  # what SSARs report allowed
        self.kubelet_mode = "ok"
        self.requests: list[tuple[str, str, object]] = []
        self.created: list[dict] = []  # pods created through the API, as created
        self.deleted: list[str] = []
        self.checkpointed: list[str] = []
        self.watchers: list[tuple[str | None, str, asyncio.Queue]] = []
        self._tasks: set[asyncio.Task] = set()
        self._hang = asyncio.Event()
        self._rv = 1000
        self.servers: list[HTTPServer] = []
        self.api_port = free_port()
        self.kubelet_port = free_port()

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    url = api_url

    def add_token(self, username: str, token: str = "") -> str:
        token = token or f"sa-{uuid.uuid4().hex}"
        self.tokens[token] = username
        return token

    def forbid(self, resource: str) -> None:
        """Deny every request on ``resource`` (``"pods"``, ``"nodes/checkpoint"`` …)."""
        self.forbidden.add(resource)

    def allow(self, *rules: tuple[str, str, str, str]) -> None:
        """Let SelfSubjectAccessReviews report ``(verb, group, resource, subresource)`` allowed."""
        self.allowed.update(rules)

    def may(self, verb: str, group: str, resource: str, sub: str = "") -> bool:
        """What a SelfSubjectAccessReview answers."""
        name = f"{resource}/{sub}" if sub else resource
        return (verb, group, resource, sub) in self.allowed and name not in self.forbidden

    def next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    @property
    def rv(self) -> int:
        return self._rv

    def kubeconfig(self, path: Path) -> str:
        """Write a kubeconfig for the hub's ServiceAccount pointing at this API server."""
        self.add_token(HUB_USER, HUB_TOKEN)
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.api_url}}],
            "users": [{"name": "hub", "user": {"token": HUB_TOKEN}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "hub"}}],
            "current-context": "fake",
        }
        Path(path).write_text(json.dumps(cfg))
        return str(path)

    async def start(self) -> FakeKube:
        api = web.Application(
            [
                (r"/version", VersionHandler),
                (
                    r"/api/v1/nodes/([^/]+)/proxy/checkpoint/([^/]+)/([^/]+)/([^/]+)",
                    ProxyCheckpointHandler,
                ),
                (r"/api/v1/nodes/([^/]+)/proxy/configz", ConfigzHandler),
                (r"/api/v1/nodes", NodeListHandler),
                (r"/api/v1/nodes/([^/]+)", NodeHandler),
                (r"/api/v1/pods", PodListHandler),
                (r"/api/v1/namespaces/([^/]+)/pods", PodListHandler),
                (r"/api/v1/namespaces/([^/]+)/pods/([^/]+)", PodHandler),
                (r"/api/v1/namespaces/([^/]+)/events", EventListHandler),
                (r"/api/v1/namespaces/([^/]+)/configmaps", ConfigMapListHandler),
                (r"/api/v1/namespaces/([^/]+)/configmaps/([^/]+)", ConfigMapHandler),
                (
                    r"/api/v1/namespaces/([^/]+)/persistentvolumeclaims/([^/]+)",
                    PVCHandler,
                ),
                (r"/apis/authentication.k8s.io/v1/tokenreviews", TokenReviewHandler),
                (
                    r"/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                    AccessReviewHandler,
                ),
            ],
            kube=self,
            default_handler_class=NotFoundHandler,
            default_handler_args={},
        )
        kubelet = web.Application(
            [
                (r"/checkpoint/([^/]+)/([^/]+)/([^/]+)", KubeletCheckpointHandler),
            ],
            kube=self,
        )
        for app, port, tls in (
            (api, self.api_port, None),
            (kubelet, self.kubelet_port, self.kubelet_ssl),
        ):
            server = HTTPServer(app, ssl_options=tls)
            server.listen(port, "127.0.0.1")
            self.servers.append(server)
        return self

    async def stop(self) -> None:
        self._hang.set()
        for _, _, q in list(self.watchers):
            q.put_nowait(None)
        for t in list(self._tasks):
            t.cancel()
        for server in self.servers:
            server.stop()
            await server.close_all_connections()
        for w in self.workloads.values():
            w.close()

    # -- objects ---------------------------------------------------------------------------

    def add_node(self, node: dict | str) -> dict:
        """Add a Node (from :func:`make_node`), or by name a 1-GPU node whose kubelet is ours."""
        if isinstance(node, str):
            node = make_node(
                node,
                gpus=1,
                runtime="containerd://2.1.4",
                kubelet="v1.34.1",
                kubelet_port=self.kubelet_port,
            )
        self.nodes[node["metadata"]["name"]] = validate(node)
        return node

    def add_configmap(self, cm: dict) -> dict:
        """Store a ConfigMap as if created through the API (e.g. a checkpoint record)."""
        meta = cm["metadata"]
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("resourceVersion", self.next_rv())
        meta.setdefault("creationTimestamp", rfc3339())
        self.configmaps[(meta["namespace"], meta["name"])] = validate(cm)
        return cm

    def add_pod(
        self,
        namespace: str,
        name: str,
        node: str,
        container: str = "notebook",
        labels: dict | None = None,
        annotations: dict | None = None,
        workload: Workload | None = None,
        pod_ip: str = "127.0.0.1",
        gpus: int = 1,
        host_pid: bool = False,
        runtime=None,
    ) -> dict:
        """Add a running pod; ``workload`` is the local process its container stands for,
        ``runtime`` (an :class:`oci_runtime.Container`) the real container it runs: the pod
        then has that container's ID, its sandbox's UID and IP, and the kubelet checkpoints
        it through the real runtime."""
        cid = uuid.uuid4().hex + uuid.uuid4().hex
        uid = str(uuid.uuid4())
        status_id = f"containerd://{cid}"
        if workload is not None:
            runtime = workload.container
        if runtime is not None:
            cid, uid, pod_ip = runtime.id, runtime.sandbox.uid, runtime.sandbox.ip
            status_id = runtime.status_id
        resources = {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {}
        spec = {
            "nodeName": node,
            "serviceAccountName": "default",
            "restartPolicy": "OnFailure",
            "containers": [
                {
                    "name": container,
                    "image": "quay.io/jupyter/pytorch-notebook:cuda12-2026-11-01",
                    "ports": [{"containerPort": 8888, "name": "notebook-port", "protocol": "TCP"}],
                    "resources": resources,
                }
            ],
        }
        if host_pid:
            spec["hostPID"] = True
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": uid,
                "resourceVersion": self.next_rv(),
                "creationTimestamp": rfc3339(),
                "labels": dict(labels or {}),
                "annotations": dict(annotations or {}),
            },
            "spec": spec,
            "status": {
                "phase": "Running",
                "hostIP": pod_ip,
                "podIP": pod_ip,
                "podIPs": [{"ip": pod_ip}],
                "startTime": rfc3339(),
                "qosClass": "Burstable",
                "conditions": [
                    {"type": "Ready", "status": "True", "lastTransitionTime": rfc3339()}
                ],
                "containerStatuses": [
                    {
                        "name": container,
                        "ready": True,
                        "restartCount": 0,
                        "started": True,
                        "image": "quay.io/jupyter/pytorch-notebook:cuda12-2026-11-01",
                        "imageID": "quay.io/jupyter/pytorch-notebook@sha256:" + "ab" * 32,
                        "containerID": status_id,
                        "state": {"running": {"startedAt": rfc3339()}},
                    }
                ],
            },
        }
        self.pods[(namespace, name)] = validate(pod)
        if workload is not None:
            self.workloads[(namespace, name)] = workload
        if runtime is not None:
            self.containers[(namespace, name)] = runtime
        self.notify("ADDED", pod)
        return pod

    def add_agent_pod(self, node: str, ip: str, namespace: str = "gpusnap-system") -> dict:
        """A running node agent DaemonSet pod on ``node`` whose pod IP is ``ip``."""
        return self.add_pod(
            namespace,
            f"gpusnap-agent-{node}",
            node,
            container="agent",
            labels={"app.kubernetes.io/name": "jupyterhub-gpusnap-agent"},
            pod_ip=ip,
            gpus=0,
            host_pid=True,
        )

    # -- the pod lifecycle (scheduler, kubelets) ---------------------------------------------

    def notify(self, kind: str, obj: dict) -> None:
        ns = obj["metadata"].get("namespace")
        for wns, selector, q in self.watchers:
            if (wns is None or wns == ns) and match_labels(
                obj["metadata"].get("labels") or {}, selector
            ):
                q.put_nowait({"type": kind, "object": copy.deepcopy(obj)})

    def spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def create_pod(self, ns: str, body: dict) -> dict:
        kubernetes_validate.validate(body, K8S_VERSION, strict=True)
        pod = copy.deepcopy(body)
        meta = pod["metadata"]
        meta.update(
            namespace=ns,
            uid=str(uuid.uuid4()),
            resourceVersion=self.next_rv(),
            creationTimestamp=rfc3339(),
        )
        pod["status"] = {"phase": "Pending", "qosClass": "Burstable"}
        self.pods[(ns, meta["name"])] = validate(pod)
        self.created.append(copy.deepcopy(pod))
        self.notify("ADDED", pod)
        self.spawn(self.schedule(ns, meta["name"]))
        return pod

    async def schedule(self, ns: str, name: str) -> None:
        await asyncio.sleep(0.05)
        pod = self.pods.get((ns, name))
        if pod is None:
            return
        node = self.pick_node(pod)
        if node is None:
            pod["status"]["conditions"] = [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": f"0/{len(self.nodes)} nodes are available: didn't match Pod's "
                    "node affinity/selector or Insufficient nvidia.com/gpu.",
                }
            ]
            pod["metadata"]["resourceVersion"] = self.next_rv()
            self.notify("MODIFIED", validate(pod))
            return
        ip = next(a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP")
        pod["spec"]["nodeName"] = node["metadata"]["name"]
        started = rfc3339()
        pod["status"].update(
            phase="Running",
            hostIP=ip,
            podIP="127.0.0.1",
            startTime=started,
            conditions=[
                {"type": "Ready", "status": "True"},
                {"type": "PodScheduled", "status": "True"},
            ],
            containerStatuses=[
                {
                    "name": c["name"],
                    "image": c["image"],
                    "imageID": c["image"],
                    "ready": True,
                    "restartCount": 0,
                    "started": True,
                    "state": {"running": {"startedAt": started}},
                    "containerID": f"cri-o://{uuid.uuid4().hex}",
                }
                for c in pod["spec"]["containers"]
            ],
        )
        pod["metadata"]["resourceVersion"] = self.next_rv()
        self.notify("MODIFIED", validate(pod))

    def gpus_used(self, node_name: str) -> int:
        used = 0
        for p in self.pods.values():
            if p["spec"].get("nodeName") == node_name:
                for c in p["spec"]["containers"]:
                    used += int(
                        ((c.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu", 0)
                    )
        return used

    def pick_node(self, pod: dict) -> dict | None:
        spec = pod["spec"]
        want_gpus = sum(
            int(((c.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu", 0))
            for c in spec["containers"]
        )
        for node in self.nodes.values():
            labels = node["metadata"]["labels"]
            if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
                continue
            terms = (
                ((spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution", {})
                .get("nodeSelectorTerms")
            )
            if terms and not any(term_matches(t, labels) for t in terms):
                continue
            have = int(node["status"]["allocatable"].get("nvidia.com/gpu", 0))
            if want_gpus and have - self.gpus_used(node["metadata"]["name"]) < want_gpus:
                continue
            return node
        return None

    def delete_pod(self, ns: str, name: str) -> dict | None:
        """Graceful deletion: ``deletionTimestamp`` now, the pod gone 50 ms later."""
        pod = self.pods.get((ns, name))
        if pod is None:
            return None
        pod["metadata"]["deletionTimestamp"] = rfc3339()
        pod["metadata"]["resourceVersion"] = self.next_rv()
        self.deleted.append(f"{ns}/{name}")
        self.notify("MODIFIED", pod)

        async def gone():
            await asyncio.sleep(0.05)
            if self.pods.get((ns, name)) is pod:
                del self.pods[(ns, name)]
                self.notify("DELETED", pod)

        self.spawn(gone())
        return pod

    # -- the kubelet's checkpoint ---------------------------------------------------------

    async def kubelet_checkpoint(self, namespace: str, name: str, container: str) -> str:
        """Checkpoint the pod's container through the real runtime; return the archive's host
        path. ``runc checkpoint --leave-running`` and the archive CRI-O writes
        (:meth:`oci_runtime.Container.checkpoint`): the kubelet only hands it out."""
        real = self.containers.get((namespace, name))
        base = f"checkpoint-{name}_{namespace}-{container}-{rfc3339()}"
        if real is None:
            raise RuntimeError(f"pod {namespace}/{name} runs no container on this node")
        archive = await asyncio.to_thread(real.checkpoint, self.checkpoints, base)
        self.archives.append(tar_names(archive))
        self.checkpointed.append(f"{namespace}/{name}/{container}")
        return f"{KUBELET_DIR}/{archive.name}"


class FakeHandler(web.RequestHandler):
    @property
    def kube(self) -> FakeKube:
        return self.settings["kube"]

    def prepare(self) -> None:
        try:
            self.body = json.loads(self.request.body) if self.request.body else None
        except ValueError:
            self.body = None
        self.kube.requests.append((self.request.method, self.request.uri, self.body))

    def user(self) -> str | None:
        scheme, _, token = self.request.headers.get("Authorization", "").partition(" ")
        return self.kube.tokens.get(token) if scheme == "Bearer" else None

    def send_json(self, obj: dict, code: int = 200) -> None:
        if obj.get("kind") in SCHEMA_FILES:
            validate(obj)
        self.set_status(code)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(obj))

    def fail(self, code: int, reason: str, message: str, details: dict | None = None) -> None:
        self.send_json(status(code, reason, message, details), code)

    def authorize(self, verb: str, resource: str, name: str = "", namespace: str = "") -> bool:
        """The API server's authn + RBAC: False (and the answer sent) when refused."""
        user = self.user()
        if user is None:
            self.fail(401, "Unauthorized", "Unauthorized")
            return False
        if resource in self.kube.forbidden:
            group, _, sub = resource.partition("/")
            where = f' in the namespace "{namespace}"' if namespace else " at the cluster scope"
            self.fail(
                403,
                "Forbidden",
                f'{group} "{name}" is forbidden: User "{user}" cannot {verb} resource "{resource}" '
                f'in API group ""{where}',
                {"name": name, "kind": group},
            )
            return False
        return True


class NotFoundHandler(FakeHandler):
    def prepare(self) -> None:
        super().prepare()
        self.fail(404, "NotFound", "the server could not find the requested resource")


class VersionHandler(FakeHandler):
    def get(self) -> None:
        v = self.kube.version.lstrip("v").split(".")
        self.send_json(
            {
                "major": v[0],
                "minor": v[1],
                "gitVersion": self.kube.version,
                "gitCommit": "0" * 40,
                "gitTreeState": "clean",
                "buildDate": "2026-01-01T00:00:00Z",
                "goVersion": "go1.24",
                "compiler": "gc",
                "platform": "linux/amd64",
            }
        )


class ListWatchHandler(FakeHandler):
    """``GET`` of a collection: a ``<Kind>List`` with label and field selectors, or with
    ``?watch=true`` a stream of WatchEvents (one JSON object a line) until ``timeoutSeconds``."""

    kind = ""
    resource = ""

    def items(self, namespace: str | None) -> list[dict]:
        return []

    async def get(self, namespace: str | None = None) -> None:
        if not self.authorize(
            "watch" if self.get_argument("watch", "") else "list",
            self.resource,
            "",
            namespace or "",
        ):
            return
        labels = self.get_argument("labelSelector", "")
        if self.get_argument("watch", "") in ("true", "1", "True"):
            return await self.watch(namespace, labels)
        fields = self.get_argument("fieldSelector", "")
        self.send_json(
            {
                "kind": f"{self.kind}List",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": self.kube.next_rv()},
                "items": [
                    o
                    for o in self.items(namespace)
                    if match_labels(o["metadata"].get("labels") or {}, labels)
                    and match_fields(o, fields)
                ],
            }
        )

    async def watch(self, namespace: str | None, selector: str) -> None:
        q: asyncio.Queue = asyncio.Queue()
        entry = (namespace, selector, q)
        self.kube.watchers.append(entry)
        deadline = time.monotonic() + float(self.get_argument("timeoutSeconds", "30"))
        self.set_header("Content-Type", "application/json")
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    event = await asyncio.wait_for(q.get(), left)
                except asyncio.TimeoutError:
                    break
                if event is None:
                    break
                self.write(json.dumps(event) + "\n")
                await self.flush()
        except StreamClosedError:
            pass
        finally:
            self.kube.watchers.remove(entry)
        if not self._finished:
            self.finish()


class PodListHandler(ListWatchHandler):
    kind = "Pod"
    resource = "pods"

    def items(self, namespace: str | None) -> list[dict]:
        return [p for (ns, _), p in sorted(self.kube.pods.items()) if namespace in (None, ns)]

    def post(self, namespace: str) -> None:
        name = (self.body or {}).get("metadata", {}).get("name", "")
        if not self.authorize("create", "pods", name, namespace):
            return
        if (namespace, name) in self.kube.pods:
            return self.fail(409, "AlreadyExists", f'pods "{name}" already exists')
        try:
            pod = self.kube.create_pod(namespace, self.body)
        except kubernetes_validate.ValidationError as e:
            return self.fail(422, "Invalid", f"Pod is invalid: {e}")
        self.send_json(pod, 201)


class EventListHandler(ListWatchHandler):
    kind = "Event"
    resource = "events"


class PodHandler(FakeHandler):
    def get(self, namespace: str, name: str) -> None:
        if not self.authorize("get", "pods", name, namespace):
            return
        pod = self.kube.pods.get((namespace, name))
        if pod is None:
            return self.fail(
                404, "NotFound", f'pods "{name}" not found', {"name": name, "kind": "pods"}
            )
        self.send_json(pod)

    def patch(self, namespace: str, name: str) -> None:
        if not self.authorize("patch", "pods", name, namespace):
            return
        pod = self.kube.pods.get((namespace, name))
        if pod is None:
            return self.fail(404, "NotFound", f'pods "{name}" not found')
        ctype = self.request.headers.get("Content-Type", "")
        if ctype != "application/merge-patch+json":
            return self.fail(415, "UnsupportedMediaType", ctype)
        annotations = ((self.body or {}).get("metadata") or {}).get("annotations") or {}
        pod["metadata"].setdefault("annotations", {}).update(annotations)
        pod["metadata"]["resourceVersion"] = self.kube.next_rv()
        kubernetes_validate.validate(
            {k: v for k, v in pod.items() if k != "status"}, K8S_VERSION, strict=True
        )
        self.kube.notify("MODIFIED", pod)
        self.send_json(pod)

    def delete(self, namespace: str, name: str) -> None:
        if not self.authorize("delete", "pods", name, namespace):
            return
        pod = self.kube.delete_pod(namespace, name)
        if pod is None:
            return self.fail(
                404, "NotFound", f'pods "{name}" not found', {"name": name, "kind": "pods"}
            )
        self.send_json(pod)


class NodeHandler(FakeHandler):
    def get(self, name: str) -> None:
        if not self.authorize("get", "nodes", name):
            return
        node = self.kube.nodes.get(name)
        if node is None:
            return self.fail(
                404, "NotFound", f'nodes "{name}" not found', {"name": name, "kind": "nodes"}
            )
        self.send_json(node)


class NodeListHandler(ListWatchHandler):
    kind = "Node"
    resource = "nodes"

    def items(self, namespace: str | None) -> list[dict]:
        return list(self.kube.nodes.values())


class ConfigzHandler(FakeHandler):
    """The kubelet's ``/configz`` through the API server's node proxy (``get nodes/proxy``)."""

    def get(self, node: str) -> None:
        user = self.user()
        if user is None:
            return self.fail(401, "Unauthorized", "Unauthorized")
        if not self.kube.may("get", "", "nodes", "proxy"):
            return self.fail(
                403,
                "Forbidden",
                f'nodes "{node}" is forbidden: User "{user}" cannot get resource "nodes/proxy" '
                'in API group "" at the cluster scope',
                {"name": node, "kind": "nodes"},
            )
        if node not in self.kube.nodes:
            return self.fail(404, "NotFound", f'nodes "{node}" not found')
        self.send_json({"kubeletconfig": self.kube.configz.get(node, {})})


class PVCHandler(FakeHandler):
    def get(self, namespace: str, name: str) -> None:
        if not self.authorize("get", "persistentvolumeclaims", name, namespace):
            return
        pvc = self.kube.pvcs.get(f"{namespace}/{name}")
        if pvc is None:
            return self.fail(404, "NotFound", f'persistentvolumeclaims "{name}" not found')
        self.send_json(pvc)


class ConfigMapListHandler(ListWatchHandler):
    kind = "ConfigMap"
    resource = "configmaps"

    def items(self, namespace: str | None) -> list[dict]:
        return [c for (ns, _), c in sorted(self.kube.configmaps.items()) if namespace in (None, ns)]

    def post(self, namespace: str) -> None:
        body = self.body or {}
        name = body.get("metadata", {}).get("name", "")
        if not self.authorize("create", "configmaps", name, namespace):
            return
        try:
            validate(body)
        except jsonschema.ValidationError as e:
            return self.fail(422, "Invalid", f"ConfigMap is invalid: {e.message}")
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name) or len(name) > 253:
            return self.fail(
                422, "Invalid", f'ConfigMap "{name}" is invalid: metadata.name: Invalid value'
            )
        if (namespace, name) in self.kube.configmaps:
            return self.fail(409, "AlreadyExists", f'configmaps "{name}" already exists')
        body["metadata"].update(
            namespace=namespace,
            uid=str(uuid.uuid4()),
            resourceVersion=self.kube.next_rv(),
            creationTimestamp=rfc3339(),
        )
        self.kube.configmaps[(namespace, name)] = body
        self.send_json(body, 201)


class ConfigMapHandler(FakeHandler):
    def get(self, namespace: str, name: str) -> None:
        if not self.authorize("get", "configmaps", name, namespace):
            return
        cm = self.kube.configmaps.get((namespace, name))
        if cm is None:
            return self.fail(
                404,
                "NotFound",
                f'configmaps "{name}" not found',
                {"name": name, "kind": "configmaps"},
            )
        self.send_json(cm)

    def delete(self, namespace: str, name: str) -> None:
        if not self.authorize("delete", "configmaps", name, namespace):
            return
        cm = self.kube.configmaps.pop((namespace, name), None)
        if cm is None:
            return self.fail(
                404,
                "NotFound",
                f'configmaps "{name}" not found',
                {"name": name, "kind": "configmaps"},
            )
        self.send_json(
            {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Success",
                "details": {"name": name, "kind": "configmaps", "uid": cm["metadata"]["uid"]},
            }
        )


class TokenReviewHandler(FakeHandler):
    def post(self) -> None:
        if not self.authorize("create", "tokenreviews"):
            return
        review = validate(json.loads(self.request.body))
        user = self.kube.tokens.get(review["spec"]["token"])
        review["status"] = (
            {
                "authenticated": True,
                "user": {
                    "username": user,
                    "uid": str(uuid.uuid5(uuid.NAMESPACE_DNS, user)),
                    "groups": ["system:serviceaccounts", "system:authenticated"],
                },
                "audiences": ["https://kubernetes.default.svc"],
            }
            if user
            else {"authenticated": False, "error": "[invalid bearer token, token lookup failed]"}
        )
        review["metadata"] = {"creationTimestamp": None}
        self.send_json(review, 201)


class AccessReviewHandler(FakeHandler):
    """SelfSubjectAccessReview: what the caller may do, from ``kube.allowed``/``forbidden``."""

    def post(self) -> None:
        if self.user() is None:
            return self.fail(401, "Unauthorized", "Unauthorized")
        review = validate(copy.deepcopy(self.body))
        kubernetes_validate.validate(review, K8S_VERSION, strict=True)
        attrs = review["spec"]["resourceAttributes"]
        allowed = self.kube.may(
            attrs.get("verb", ""),
            attrs.get("group", ""),
            attrs.get("resource", ""),
            attrs.get("subresource", ""),
        )
        review["metadata"] = {"creationTimestamp": None}
        review["status"] = {"allowed": allowed}
        if not allowed:
            review["status"]["reason"] = ""
        self.send_json(review, 201)


async def _checkpoint(handler: FakeHandler, namespace: str, pod: str, container: str) -> None:
    """The kubelet's checkpoint handler (shared by the direct route and the node proxy)."""
    kube = handler.kube
    timeout = handler.get_argument("timeout", "")
    if kube.kubelet_mode == "gate-off" or (timeout and not timeout.isdigit()):
        handler.set_status(404)
        handler.set_header("Content-Type", "text/plain; charset=utf-8")
        return handler.finish("404 page not found\n")
    if (namespace, pod) not in kube.pods or container not in [
        c["name"] for c in kube.pods[(namespace, pod)]["spec"]["containers"]
    ]:
        handler.set_status(500)
        return handler.finish(
            f"checkpointing of {namespace}/{pod}/{container} failed "
            f"(container {container} not found in pod {pod})"
        )
    if kube.kubelet_mode == "hang":
        await kube._hang.wait()
        return
    if kube.kubelet_mode == "error":
        handler.set_status(500)
        return handler.finish(
            f"checkpointing of {namespace}/{pod}/{container} failed (rpc error: code = Unknown desc = "
            f'failed to checkpoint container {container}: running "criu" failed: exit status 1)'
        )
    try:
        path = await kube.kubelet_checkpoint(namespace, pod, container)
    except (RuntimeError, AssertionError) as e:  # the runtime failed: the kubelet's 500
        handler.set_status(500)
        return handler.finish(
            f"checkpointing of {namespace}/{pod}/{container} failed (rpc error: code = Unknown "
            f"desc = failed to checkpoint container {container}: {e})"
        )
    handler.set_header("Content-Type", "application/json")
    handler.finish(json.dumps({"items": [path]}))


class KubeletCheckpointHandler(FakeHandler):
    async def post(self, namespace: str, pod: str, container: str) -> None:
        user = self.user()
        if user is None:
            self.set_status(401)
            return self.finish("Unauthorized")
        if "nodes/checkpoint" in self.kube.forbidden or self.kube.kubelet_mode == "forbidden":
            self.set_status(403)
            return self.finish(
                f"Forbidden (user={user}, verb=create, resource=nodes, subresource=checkpoint)"
            )
        await _checkpoint(self, namespace, pod, container)


class ProxyCheckpointHandler(FakeHandler):
    async def post(self, node: str, namespace: str, pod: str, container: str) -> None:
        if not self.authorize("create", "nodes/proxy", node):
            return
        if node not in self.kube.nodes:
            return self.fail(404, "NotFound", f'nodes "{node}" not found')
        await _checkpoint(self, namespace, pod, container)


def tar_names(path: Path) -> list[str]:
    with tarfile.open(path) as tar:
        return tar.getnames()


def tar_bytes(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


# -- wiring the agent and the hub side to the fakes ------------------------------------

AGENT_SECRET = "agent-shared-secret"
NODE = "gpu-node-1"


class Cluster:
    """A fake cluster with one GPU node, a running agent on it, and token files for both sides."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.kube = FakeKube(self.root / "kube")
        self.agent = None
        self.agents: dict = {}  # node name -> its AgentApp (the first is self.agent)
        self.trees: dict[str, NodeTree] = {}  # node name -> its /proc and cgroup tree

    async def start(self, **agent_config) -> Cluster:
        from jupyterhub_gpusnap.agent.app import AgentApp

        await self.kube.start()
        self.kube.add_node(NODE)
        self.agent_sa = "system:serviceaccount:gpusnap:agent"
        self.hub_sa = "system:serviceaccount:jhub:hub"
        self.agent_token_file = self.root / "agent-sa-token"
        self.agent_token_file.write_text(self.kube.add_token(self.agent_sa))
        self.hub_token_file = self.root / "hub-sa-token"
        self.hub_token_file.write_text(self.kube.add_token(self.hub_sa))
        self.secret_file = self.root / "agent-secret"
        self.secret_file.write_text(AGENT_SECRET + "\n")
        self.tree = NodeTree(self.root / "node")
        self._agent_config = agent_config
        self.agent = AgentApp(
            config=self._config_for(NODE, "127.0.0.1", 0, self.tree, self.root / "restore")
        )
        await self.agent.start_http()
        self.agents = {NODE: self.agent}
        self.trees = {NODE: self.tree}
        # RBAC as the agent's ClusterRole grants it: what the agent uses (SSARs say allowed)
        self.kube.allow(
            *((n.verb, n.group, n.resource, n.subresource) for n in self.agent.rbac_needs())
        )
        self.kube.add_pod(
            "gpusnap",
            "gpusnap-agent-x7k2p",
            NODE,
            container="agent",
            labels={"app.kubernetes.io/name": "jupyterhub-gpusnap-agent"},
            gpus=0,
        )
        return self

    def _config_for(self, node: str, ip: str, port: int, tree: NodeTree, restore_dir: Path):
        """The agent's config on ``node``: listening on ``ip:port``, reading ``tree``."""
        from traitlets.config import Config

        c = Config()
        c.AgentApp.node_name = node
        c.AgentApp.ip = ip
        c.AgentApp.port = port
        c.AgentApp.api_token_file = str(self.secret_file)
        c.AgentApp.checkpoint_dir = str(self.kube.checkpoints)
        c.AgentApp.restore_dir = str(restore_dir)
        c.AgentApp.criu_path = CRIU
        c.AgentApp.runtime_state_dirs = [str(RUNC_ROOT)]
        c.AgentApp.cpu_sample_seconds = 0.01
        c.KubeAPI.api_url = self.kube.api_url
        c.KubeAPI.token_file = str(self.agent_token_file)
        c.KubeletClient.kubelet_scheme = "http"
        c.KubeletClient.timeout_grace = 0.5
        c.Shipper.registry_scheme = "http"
        c.Shipper.chunk_size = 1 << 20
        c.PodMapper.proc_root = str(tree.proc)
        c.PodMapper.cgroup_root = str(tree.cgroup)
        for key, value in self._agent_config.items():
            section, _, name = key.partition("__")
            setattr(c[section], name, value)
        return c

    async def add_gpu_node(self, node: str, ip: str):
        """A second (third, …) GPU node with its own real agent, /proc and cgroup tree.

        Its agent listens on ``ip`` (another loopback address, e.g. 127.0.0.2) at the
        first agent's port, since the hub side has one ``agent_port`` for all agents; its
        agent pod carries ``ip`` as pod IP, so the hub side finds it by node as in a cluster.
        """
        from jupyterhub_gpusnap.agent.app import AgentApp

        self.kube.add_node(node)
        tree = NodeTree(self.root / f"node-{node}")
        agent = AgentApp(
            config=self._config_for(node, ip, self.agent.port, tree, self.root / f"restore-{node}")
        )
        await agent.start_http()
        self.agents[node], self.trees[node] = agent, tree
        self.kube.add_pod(
            "gpusnap",
            f"gpusnap-agent-{node}",
            node,
            container="agent",
            labels={"app.kubernetes.io/name": "jupyterhub-gpusnap-agent"},
            pod_ip=ip,
            gpus=0,
        )
        return agent

    @property
    def agent_url(self) -> str:
        return f"http://127.0.0.1:{self.agent.port}"

    async def agent_call(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        token: str = AGENT_SECRET,
        timeout: float = 120,
    ) -> tuple[int, dict]:
        """Call the agent's HTTP API as the service does; return (status, JSON body)."""
        from tornado.httpclient import AsyncHTTPClient

        r = await AsyncHTTPClient().fetch(
            self.agent_url + path,
            method=method,
            raise_error=False,
            headers={"Authorization": f"Bearer {token}"} if token else {},
            body=json.dumps(body) if body is not None else None,
            request_timeout=timeout,
        )
        return r.code, json.loads(r.body)

    def hub_config(self, **extra):
        """Config for the hub side (KubernetesBackend, AgentSignal) pointing at this cluster."""
        from traitlets.config import Config

        c = Config()
        c.AgentLocator.namespace = "jhub"
        c.AgentConnection.agent_namespace = "gpusnap"
        c.AgentConnection.agent_port = self.agent.port
        c.AgentConnection.agent_token_file = str(self.secret_file)
        c.KubeAPI.api_url = self.kube.api_url
        c.KubeAPI.token_file = str(self.hub_token_file)
        for key, value in extra.items():
            section, _, name = key.partition("__")
            setattr(c[section], name, value)
        return c

    def add_user_pod(
        self,
        user: str,
        workload: Workload | None = None,
        name: str = "",
        placeholder_for: str = "",
        node: str = NODE,
        runtime=None,
    ) -> dict:
        """A user's server pod (on ``node``); with ``placeholder_for`` the placeholder
        SnapKubeSpawner creates to restore that checkpoint image into; ``runtime``: the
        real container (:class:`oci_runtime.Container`) the pod runs."""
        pod = f"jupyter-{user}" + (f"--{name}" if name else "")
        annotations = {"hub.jupyter.org/username": user, "hub.jupyter.org/servername": name}
        if placeholder_for:
            annotations["gpusnap.jupyter.org/placeholder-for"] = placeholder_for
        return self.kube.add_pod(
            "jhub",
            pod,
            node,
            workload=workload,
            labels={"component": "singleuser-server", "hub.jupyter.org/username": user},
            annotations=annotations,
            runtime=runtime,
        )

    async def restore_into(
        self, image: str, container: str = "notebook", pod: str = "jupyter-alice"
    ) -> tuple[int, dict]:
        """``POST /v1/restore`` of ``image`` into ``jhub/<pod>``'s ``container``."""
        body = {"namespace": "jhub", "pod": pod, "container": container, "image": image}
        return await self.agent_call("POST", "/v1/restore", body)

    def map_process(self, pod: dict, pid: int, usage_usec: int = 0) -> None:
        """Make ``pid`` a process of ``pod``'s first container, as the /proc and cgroup
        tree of the pod's node show it to that node's agent."""
        status_id = pod["status"]["containerStatuses"][0]["containerID"]
        tree = self.trees.get(pod["spec"]["nodeName"], self.tree)
        tree.add_pod_process(pid, pod["metadata"]["uid"], container_id(status_id), usage_usec)

    async def stop(self) -> None:
        for agent in self.agents.values():
            await agent.stop_http()
        await self.kube.stop()


# ---------------------------------------------------------------- the fake node agent


class FakeAgent:
    """A node agent at wire level: bearer auth, the contract's paths and JSON."""

    def __init__(
        self, kube: FakeKube, token: str = "agent-secret", host: str = "127.0.0.1", port: int = 0
    ):
        self.kube = kube
        self.token = token
        self.host = host
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        self.requests: list[tuple[str, str, dict | None]] = []
        self.restore_error: dict | None = None
        self.doctor_checks: list[dict] = []
        self.health = {"ok": True, "node": "", "criu": "4.2.1", "driver": "580.159.04"}
        self.restored_servers: list[HTTPServer] = []
        self.server: HTTPServer | None = None

    async def start(self) -> FakeAgent:
        agent = self

        class Base(web.RequestHandler):
            def prepare(self):
                body = json.loads(self.request.body) if self.request.body else None
                agent.requests.append((self.request.method, self.request.uri, body))
                self.body = body
                if self.request.headers.get("Authorization") != f"Bearer {agent.token}":
                    self.set_status(401)
                    self.finish({"error": "bad token", "fix": "use the agent's api_token"})

        class Health(Base):
            def get(self):
                self.finish(agent.health)

        class Doctor(Base):
            def get(self):
                self.finish({"checks": agent.doctor_checks})

        class Restore(Base):
            async def post(self):
                from jupyterhub_gpusnap.kubespawner import PLACEHOLDER_ANNOTATION

                b = self.body
                assert set(b) == {"namespace", "pod", "container", "image"}, b
                if agent.restore_error:
                    self.set_status(500)
                    return self.finish(agent.restore_error)
                pod = agent.kube.pods.get((b["namespace"], b["pod"]))
                if (
                    pod is None
                    or pod["metadata"]["annotations"].get(PLACEHOLDER_ANNOTATION) != b["image"]
                ):
                    self.set_status(409)
                    return self.finish(
                        {
                            "error": "no placeholder pod for this image",
                            "fix": "create the placeholder first",
                        }
                    )
                port = next(
                    p["containerPort"]
                    for c in pod["spec"]["containers"]
                    for p in c.get("ports", [])
                    if p.get("name") == "notebook-port"
                )
                agent.restored_servers.append(await serve_notebook_api(port))
                self.finish({"restored": True, "pid": 4242})

        app = web.Application(
            [(r"/healthz", Health), (r"/v1/doctor", Doctor), (r"/v1/restore", Restore)]
        )
        self.server = HTTPServer(app)
        self.server.listen(self.port, self.host)
        return self

    async def stop(self) -> None:
        for s in [self.server, *self.restored_servers]:
            if s:
                s.stop()
                await s.close_all_connections()


async def serve_notebook_api(port: int) -> HTTPServer:
    """A real HTTP server answering ``/user/alice/api`` like a Jupyter server."""

    class Api(web.RequestHandler):
        def get(self):
            self.finish({"version": "2.21.0"})

    server = HTTPServer(web.Application([(r"/user/alice/api", Api)]))
    server.listen(port, "127.0.0.1")
    return server


# ---------------------------------------------------------------- fixtures


@contextlib.asynccontextmanager
async def fake_cluster(tmp_path, monkeypatch):
    """A FakeKube with a CPU node and two GPU nodes, and kubeconfig pointing at it."""
    fake = await FakeKube(tmp_path / "kube").start()
    import kubernetes_asyncio.config.kube_config as kc

    monkeypatch.setattr(
        kc, "KUBE_CONFIG_DEFAULT_LOCATION", fake.kubeconfig(tmp_path / "kubeconfig")
    )
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    fake.add_node(make_node("cpu-1"))
    fake.add_node(make_node("gpu-a100", A100, 4))
    fake.add_node(make_node("gpu-h100", H100, 2))
    try:
        yield fake
    finally:
        from jupyterhub_gpusnap.kubespawner import SnapKubeSpawner

        await SnapKubeSpawner._stop_all_reflectors()
        await fake.stop()
