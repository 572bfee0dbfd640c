"""SnapKubeSpawner against a wire-level fake Kubernetes API server and node agent.

The fake API server is a real tornado HTTP server answering the exact REST paths
KubeSpawner (through kubernetes_asyncio) uses, with Pod/Status/WatchEvent JSON; every
created pod is validated with kubernetes_validate. Its "scheduler" honours nodeSelector,
required node affinity (``In``) and GPU capacity, so a pod pinned to a GPU model no node
has stays Pending, as on a cluster. The fake node agent is a real HTTP server following
the agent contract (``POST /v1/restore`` …); a successful restore starts a real HTTP
server on the pod's port, standing in for the restored notebook server.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import time
import uuid
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import kubernetes_validate
import pytest
import tornado.web
from jupyterhub import orm
from ports import free_port
from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.httpserver import HTTPServer
from traitlets.config import Config

from jupyterhub_gpusnap.kubespawner import (
    CHECKPOINT_ANNOTATION,
    PLACEHOLDER_ANNOTATION,
    RESTORED_FROM_ANNOTATION,
    SnapKubeSpawner,
)

pytestmark = pytest.mark.k8s

K8S_VERSION = "1.33"
H100 = "NVIDIA-H100-80GB-HBM3"
A100 = "NVIDIA-A100-SXM4-80GB"




def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_json(code: int, reason: str, message: str) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def make_node(
    name: str,
    gpu_product: str | None = None,
    gpus: int = 0,
    runtime: str = "cri-o://1.33.2",
    kubelet: str = "v1.33.4",
    ip: str = "127.0.0.1",
) -> dict:
    labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}
    capacity = {"cpu": "16", "memory": "128Gi", "pods": "110"}
    if gpu_product:
        labels["nvidia.com/gpu.product"] = gpu_product
        labels["nvidia.com/gpu.present"] = "true"
        labels["nvidia.com/gpu.count"] = str(gpus)
        capacity["nvidia.com/gpu"] = str(gpus)
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "uid": str(uuid.uuid4()),
            "labels": labels,
            "resourceVersion": "1",
            "creationTimestamp": now_rfc3339(),
        },
        "spec": {},
        "status": {
            "capacity": capacity,
            "allocatable": dict(capacity),
            "addresses": [
                {"type": "InternalIP", "address": ip},
                {"type": "Hostname", "address": name},
            ],
            "nodeInfo": {
                "architecture": "amd64",
                "bootID": "b",
                "containerRuntimeVersion": runtime,
                "kernelVersion": "6.8.0",
                "kubeProxyVersion": kubelet,
                "kubeletVersion": kubelet,
                "machineID": "m",
                "operatingSystem": "linux",
                "osImage": "Ubuntu 24.04",
                "systemUUID": "s",
            },
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    kubernetes_validate.validate(node, K8S_VERSION, strict=True)
    return node


class FakeKube:
    """The Kubernetes API server (and the kubelets' pod lifecycle) at wire level."""

    def __init__(self, version: str = "v1.33.4"):
        self.version = version
        self.nodes: dict[str, dict] = {}
        self.pods: dict[str, dict] = {}
        self.pvcs: dict[str, dict] = {}
        self.configmaps: list[dict] = []
        self.configz: dict[str, dict] = {}  # node -> kubeletconfig (absent: 403 from proxy)
        self.allowed: set[tuple] = set()  # (verb, group, resource, subresource)
        self.requests: list[tuple[str, str, object]] = []
        self.created: list[dict] = []
        self.rv = 10
        self.watchers: list[tuple[str, str, asyncio.Queue]] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: HTTPServer | None = None
        self._tasks: set[asyncio.Task] = set()

    # ----- lifecycle -----
    async def start(self) -> FakeKube:
        app = tornado.web.Application(
            [
                (r"/version", VersionHandler, {"kube": self}),
                (r"/api/v1/namespaces/([^/]+)/pods", PodsHandler, {"kube": self}),
                (r"/api/v1/namespaces/([^/]+)/pods/([^/]+)", PodHandler, {"kube": self}),
                (r"/api/v1/namespaces/([^/]+)/events", EventsHandler, {"kube": self}),
                (
                    r"/api/v1/namespaces/([^/]+)/persistentvolumeclaims/([^/]+)",
                    PVCHandler,
                    {"kube": self},
                ),
                (r"/api/v1/namespaces/([^/]+)/configmaps", ConfigMapsHandler, {"kube": self}),
                (r"/api/v1/nodes", NodesHandler, {"kube": self}),
                (r"/api/v1/nodes/([^/]+)", NodeHandler, {"kube": self}),
                (r"/api/v1/nodes/([^/]+)/proxy/configz", ConfigzHandler, {"kube": self}),
                (
                    r"/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                    SSARHandler,
                    {"kube": self},
                ),
            ]
        )
        self.server = HTTPServer(app)
        self.server.listen(self.port, "127.0.0.1")
        return self

    async def stop(self) -> None:
        for _, _, q in list(self.watchers):
            q.put_nowait(None)
        for t in list(self._tasks):
            t.cancel()
        if self.server:
            self.server.stop()
            await self.server.close_all_connections()

    def kubeconfig(self, path) -> str:
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "hub", "user": {"token": "kube-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "hub"}}],
            "current-context": "fake",
        }
        path.write_text(json.dumps(cfg))
        return str(path)

    def add_node(self, node: dict) -> None:
        self.nodes[node["metadata"]["name"]] = node

    def add_agent_pod(self, node: str, ip: str, namespace: str = "gpusnap-system") -> dict:
        """A running agent DaemonSet pod on ``node`` whose pod IP is ``ip``."""
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"gpusnap-agent-{node}",
                "namespace": namespace,
                "uid": str(uuid.uuid4()),
                "resourceVersion": self.next_rv(),
                "labels": {"app.kubernetes.io/name": "jupyterhub-gpusnap-agent"},
            },
            "spec": {
                "nodeName": node,
                "hostPID": True,
                "containers": [
                    {"name": "agent", "image": "registry.example.org/gpusnap/agent:0.1.0"}
                ],
            },
            "status": {"phase": "Running", "podIP": ip, "hostIP": ip},
        }
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
        self.pods[f"{namespace}/{pod['metadata']['name']}"] = pod
        return pod

    def allow(self, *rules: tuple) -> None:
        self.allowed.update(rules)

    # ----- objects -----
    def next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def notify(self, kind: str, pod: dict) -> None:
        ns = pod["metadata"]["namespace"]
        for wns, selector, q in self.watchers:
            if wns == ns and matches_labels(pod, selector):
                q.put_nowait({"type": kind, "object": copy.deepcopy(pod)})

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
            creationTimestamp=now_rfc3339(),
        )
        pod["status"] = {"phase": "Pending", "qosClass": "Burstable"}
        self.pods[f"{ns}/{meta['name']}"] = pod
        self.created.append(copy.deepcopy(pod))
        self.notify("ADDED", pod)
        self.spawn(self.schedule(ns, meta["name"]))
        return pod

    async def schedule(self, ns: str, name: str) -> None:
        await asyncio.sleep(0.05)
        pod = self.pods.get(f"{ns}/{name}")
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
            self.notify("MODIFIED", pod)
            return
        ip = next(a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP")
        pod["spec"]["nodeName"] = node["metadata"]["name"]
        started = now_rfc3339()
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
        self.notify("MODIFIED", pod)

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

    async def delete_pod(self, ns: str, name: str) -> dict | None:
        pod = self.pods.get(f"{ns}/{name}")
        if pod is None:
            return None
        pod["metadata"]["deletionTimestamp"] = now_rfc3339()
        pod["metadata"]["resourceVersion"] = self.next_rv()
        self.notify("MODIFIED", pod)

        async def gone():
            await asyncio.sleep(0.05)
            if self.pods.pop(f"{ns}/{name}", None) is not None:
                self.notify("DELETED", pod)

        self.spawn(gone())
        return pod


def term_matches(term: dict, labels: dict) -> bool:
    for expr in term.get("matchExpressions") or []:
        op, key, values = expr["operator"], expr["key"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
    return True


def matches_fields(obj: dict, selector: str) -> bool:
    for part in filter(None, selector.split(",")):
        k, _, v = part.partition("=")
        value = obj
        for step in k.split("."):
            value = (value or {}).get(step) if isinstance(value, dict) else None
        if (value or "") != v:
            return False
    return True


def matches_labels(obj: dict, selector: str) -> bool:
    labels = obj["metadata"].get("labels") or {}
    for part in filter(None, selector.split(",")):
        k, _, v = part.partition("=")
        if labels.get(k) != v:
            return False
    return True


class KubeHandler(tornado.web.RequestHandler):
    def initialize(self, kube: FakeKube):
        self.kube = kube

    def prepare(self):
        auth = self.request.headers.get("Authorization", "")
        body = json.loads(self.request.body) if self.request.body else None
        self.kube.requests.append((self.request.method, self.request.uri, body))
        if auth != "Bearer kube-token":
            self.fail(401, "Unauthorized", "Unauthorized")
        self.body = body

    def reply(self, obj: dict, code: int = 200):
        self.set_status(code)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(obj))

    def fail(self, code: int, reason: str, message: str):
        self.reply(status_json(code, reason, message), code)


class VersionHandler(KubeHandler):
    def get(self):
        v = self.kube.version.lstrip("v").split(".")
        self.reply(
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


class ListWatchHandler(KubeHandler):
    kind = ""

    def items(self, ns: str) -> list[dict]:
        return []

    async def get(self, ns):
        selector = self.get_argument("labelSelector", "")
        if self.get_argument("watch", "") in ("true", "1", "True"):
            await self.watch(ns, selector)
            return
        fields = self.get_argument("fieldSelector", "")
        items = [
            p for p in self.items(ns) if matches_labels(p, selector) and matches_fields(p, fields)
        ]
        self.reply(
            {
                "kind": f"{self.kind}List",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.kube.rv)},
                "items": items,
            }
        )

    async def watch(self, ns: str, selector: str):
        q: asyncio.Queue = asyncio.Queue()
        entry = (ns, selector, q)
        self.kube.watchers.append(entry)
        timeout = float(self.get_argument("timeoutSeconds", "30"))
        self.set_header("Content-Type", "application/json")
        deadline = time.monotonic() + timeout
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
        except tornado.iostream.StreamClosedError:
            pass
        finally:
            self.kube.watchers.remove(entry)
        if not self._finished:
            self.finish()


class PodsHandler(ListWatchHandler):
    kind = "Pod"

    def items(self, ns):
        return [p for p in self.kube.pods.values() if p["metadata"]["namespace"] == ns]

    def post(self, ns):
        name = self.body["metadata"]["name"]
        if f"{ns}/{name}" in self.kube.pods:
            return self.fail(409, "AlreadyExists", f'pods "{name}" already exists')
        try:
            pod = self.kube.create_pod(ns, self.body)
        except kubernetes_validate.ValidationError as e:
            return self.fail(422, "Invalid", f"Pod is invalid: {e}")
        self.reply(pod, 201)


class EventsHandler(ListWatchHandler):
    kind = "Event"


class PodHandler(KubeHandler):
    def get(self, ns, name):
        pod = self.kube.pods.get(f"{ns}/{name}")
        if pod is None:
            return self.fail(404, "NotFound", f'pods "{name}" not found')
        self.reply(pod)

    def patch(self, ns, name):
        pod = self.kube.pods.get(f"{ns}/{name}")
        if pod is None:
            return self.fail(404, "NotFound", f'pods "{name}" not found')
        ctype = self.request.headers.get("Content-Type", "")
        if ctype != "application/merge-patch+json":
            return self.fail(415, "UnsupportedMediaType", ctype)
        annotations = (self.body.get("metadata") or {}).get("annotations") or {}
        pod["metadata"].setdefault("annotations", {}).update(annotations)
        pod["metadata"]["resourceVersion"] = self.kube.next_rv()
        kubernetes_validate.validate(
            {k: v for k, v in pod.items() if k != "status"}, K8S_VERSION, strict=True
        )
        self.kube.notify("MODIFIED", pod)
        self.reply(pod)

    async def delete(self, ns, name):
        pod = await self.kube.delete_pod(ns, name)
        if pod is None:
            return self.fail(404, "NotFound", f'pods "{name}" not found')
        self.reply(pod)


class PVCHandler(KubeHandler):
    def get(self, ns, name):
        pvc = self.kube.pvcs.get(f"{ns}/{name}")
        if pvc is None:
            return self.fail(404, "NotFound", f'persistentvolumeclaims "{name}" not found')
        self.reply(pvc)


class ConfigMapsHandler(ListWatchHandler):
    kind = "ConfigMap"

    def items(self, ns):
        return [c for c in self.kube.configmaps if c["metadata"]["namespace"] == ns]


class NodeHandler(KubeHandler):
    def get(self, name):
        node = self.kube.nodes.get(name)
        if node is None:
            return self.fail(404, "NotFound", f'nodes "{name}" not found')
        self.reply(node)


class NodesHandler(KubeHandler):
    def get(self):
        self.reply(
            {
                "kind": "NodeList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.kube.rv)},
                "items": list(self.kube.nodes.values()),
            }
        )


class ConfigzHandler(KubeHandler):
    def get(self, node):
        if ("get", "", "nodes", "proxy") not in self.kube.allowed:
            return self.fail(
                403,
                "Forbidden",
                f'nodes "{node}" is forbidden: User "system:serviceaccount:jhub:hub" cannot get resource "nodes/proxy"',
            )
        if node not in self.kube.nodes:
            return self.fail(404, "NotFound", f'nodes "{node}" not found')
        self.reply({"kubeletconfig": self.kube.configz.get(node, {})})


class SSARHandler(KubeHandler):
    def post(self):
        kubernetes_validate.validate(self.body, K8S_VERSION, strict=True)
        attrs = self.body["spec"]["resourceAttributes"]
        key = (
            attrs.get("verb", ""),
            attrs.get("group", ""),
            attrs.get("resource", ""),
            attrs.get("subresource", ""),
        )
        out = copy.deepcopy(self.body)
        out["metadata"] = {"creationTimestamp": None}
        out["status"] = {"allowed": key in self.kube.allowed}
        if not out["status"]["allowed"]:
            out["status"]["reason"] = ""
        self.reply(out, 201)


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

        class Base(tornado.web.RequestHandler):
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
                b = self.body
                assert set(b) == {"namespace", "pod", "container", "image"}, b
                if agent.restore_error:
                    self.set_status(500)
                    return self.finish(agent.restore_error)
                pod = agent.kube.pods.get(f"{b['namespace']}/{b['pod']}")
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

        app = tornado.web.Application(
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

    class Api(tornado.web.RequestHandler):
        def get(self):
            self.finish({"version": "2.21.0"})

    server = HTTPServer(tornado.web.Application([(r"/user/alice/api", Api)]))
    server.listen(port, "127.0.0.1")
    return server


# ---------------------------------------------------------------- fixtures


@contextlib.asynccontextmanager
async def fake_cluster(tmp_path, monkeypatch):
    """A FakeKube with a CPU node and two GPU nodes, and kubeconfig pointing at it."""
    fake = await FakeKube().start()
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
        await SnapKubeSpawner._stop_all_reflectors()
        await fake.stop()


@pytest.fixture
async def kube(tmp_path, monkeypatch):
    async with fake_cluster(tmp_path, monkeypatch) as fake:
        yield fake


@pytest.fixture
async def agent(kube):
    a = await FakeAgent(kube).start()
    for node in ("gpu-a100", "gpu-h100"):
        kube.add_agent_pod(node, a.host)
    yield a
    await a.stop()


def make_spawner(kube: FakeKube, agent: FakeAgent | None = None, **traits) -> SnapKubeSpawner:
    c = Config()
    cfg = c.SnapKubeSpawner
    cfg.k8s_api_host = kube.url
    cfg.namespace = "jhub"
    cfg.events_enabled = False
    cfg.image = "quay.io/jupyter/pytorch-notebook:2026-11-01"
    cfg.cmd = ["jupyterhub-singleuser"]
    cfg.port = free_port()
    cfg.extra_resource_limits = {"nvidia.com/gpu": "1"}
    cfg.start_timeout = 30
    cfg.k8s_api_request_retry_timeout = 10
    cfg.restore_timeout = 15
    cfg.server_poll_interval = 0.05
    if agent is not None:
        cfg.agent_namespace = "gpusnap-system"
        cfg.agent_port = agent.port
        cfg.agent_api_token = agent.token
    for k, v in traits.items():
        setattr(cfg, k, v)
    user = SimpleNamespace(name="alice", id=7, url="/user/alice/")
    hub = SimpleNamespace(
        api_url="http://hub:8081/hub/api",
        base_url="/hub/",
        url="http://hub:8081/hub/",
        public_host="",
    )
    orm_spawner = orm.Spawner(name="")
    spawner = SnapKubeSpawner(config=c, user=user, hub=hub, orm_spawner=orm_spawner, _mock=True)
    spawner.api_token = "fresh-token-from-hub"
    return spawner


def checkpoint(**over) -> dict:
    info = {
        "id": "registry.example.org/gpusnap/alice@sha256:" + "ab" * 32,
        "user": "alice",
        "server_name": "",
        "created": 1795000000.0,
        "status": "verified",
        "image_bytes": 12 * 1024**3,
        "gpu_bytes": 10 * 1024**3,
        "gpu_model": H100,
        "gpu_count": 2,
        "location": "registry",
        "error": "",
        "extra": {},
        "server": "alice/",
    }
    info.update(over)
    return info


def suspended_state(info: dict) -> dict:
    return {
        "pod_name": "jupyter-alice",
        "namespace": "jhub",
        "dns_name": "jupyter-alice.jhub.svc.cluster.local",
        "kubespawner_version": "7.1.0",
        "gpusnap": {"checkpoint": info, "api_token": "old-token-held-by-the-processes"},
    }


async def start_with_progress(spawner: SnapKubeSpawner) -> tuple[str, list[dict]]:
    events: list[dict] = []
    fut = spawner.start()

    async def collect():
        async for e in spawner.progress():
            events.append(e)

    collector = asyncio.ensure_future(collect())
    url = await fut
    await asyncio.wait_for(collector, 10)
    return url, events


def container(pod: dict) -> dict:
    return next(c for c in pod["spec"]["containers"] if c["name"] == "notebook")


# ---------------------------------------------------------------- tests


async def test_stop_keeps_checkpoint_and_token_across_clear_state(kube):
    spawner = make_spawner(kube)
    await spawner.start()
    assert "jhub/jupyter-alice" in kube.pods

    # the service records its verified checkpoint on the pod before stopping the server
    info = checkpoint(created=time.time())
    req = HTTPRequest(
        f"{kube.url}/api/v1/namespaces/jhub/pods/jupyter-alice",
        method="PATCH",
        headers={
            "Authorization": "Bearer kube-token",
            "Content-Type": "application/merge-patch+json",
        },
        body=json.dumps({"metadata": {"annotations": {CHECKPOINT_ANNOTATION: json.dumps(info)}}}),
    )
    await AsyncHTTPClient().fetch(req)

    await spawner.stop()
    assert "jhub/jupyter-alice" not in kube.pods
    assert spawner.will_resume is True  # the Hub keeps the API token
    spawner.clear_state()  # as User.stop does
    state = spawner.get_state()
    assert state["gpusnap"]["checkpoint"]["id"] == info["id"]
    assert state["gpusnap"]["api_token"] == "fresh-token-from-hub"

    # a new spawner object (after a hub restart) loads it from the database
    again = make_spawner(kube)
    again.load_state(json.loads(json.dumps(state)))
    again.clear_state()  # as User.spawn does before start
    assert again.pending_checkpoint["id"] == info["id"]
    assert again.will_resume is True


async def test_stop_without_checkpoint_forgets_token(kube):
    spawner = make_spawner(kube)
    await spawner.start()
    await spawner.stop()
    spawner.clear_state()
    assert spawner.will_resume is False
    assert "gpusnap" not in spawner.get_state()


async def test_unverified_checkpoint_annotation_is_ignored(kube):
    spawner = make_spawner(kube)
    await spawner.start()
    kube.pods["jhub/jupyter-alice"]["metadata"].setdefault("annotations", {})[
        CHECKPOINT_ANNOTATION
    ] = json.dumps(checkpoint(status="writing"))
    await spawner.stop()
    assert spawner.will_resume is False
    assert spawner.pending_checkpoint is None


async def test_agent_restore_into_placeholder_on_same_gpu_model(kube, agent):
    info = checkpoint()
    spawner = make_spawner(kube, agent)
    spawner.load_state(suspended_state(info))
    spawner.clear_state()

    url, events = await start_with_progress(spawner)

    # one pod, the placeholder: same image, sleeping, same GPU count, pinned to the H100 model
    assert len(kube.created) == 1
    pod = kube.created[0]
    kubernetes_validate.validate(
        {k: v for k, v in pod.items() if k != "status"}, K8S_VERSION, strict=True
    )
    c = container(pod)
    assert c["image"] == "quay.io/jupyter/pytorch-notebook:2026-11-01"
    assert c["command"] == ["sleep", "infinity"]
    assert "args" not in c
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert pod["metadata"]["annotations"][PLACEHOLDER_ANNOTATION] == info["id"]
    terms = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert terms == [
        {
            "matchExpressions": [
                {"key": "nvidia.com/gpu.product", "operator": "In", "values": [H100]}
            ]
        }
    ]
    assert kube.pods["jhub/jupyter-alice"]["spec"]["nodeName"] == "gpu-h100"

    # the agent on that node was asked to restore exactly this image into the pod
    restores = [r for r in agent.requests if r[1] == "/v1/restore"]
    assert restores == [
        (
            "POST",
            "/v1/restore",
            {
                "namespace": "jhub",
                "pod": "jupyter-alice",
                "container": "notebook",
                "image": info["id"],
            },
        )
    ]
    assert url == f"http://127.0.0.1:{spawner.port}"
    # the server's old token is back, the checkpoint is consumed, the restore recorded
    assert spawner.api_token == "old-token-held-by-the-processes"
    state = spawner.get_state()["gpusnap"]
    assert "checkpoint" not in state and "api_token" not in state
    assert state["restored"]["id"] == info["id"]
    messages = [e["message"] for e in events]
    assert any("12.0 GiB snapshot" in m for m in messages), messages
    assert any("gpu-h100" in m for m in messages), messages
    assert messages[-1] == "Server restored from its snapshot."


async def test_admin_affinity_is_kept_and_extended(kube, agent):
    info = checkpoint(gpu_count=1)
    term = {
        "matchExpressions": [
            {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["z1"]}
        ]
    }
    spawner = make_spawner(kube, agent, node_affinity_required=[term])
    kube.nodes["gpu-h100"]["metadata"]["labels"]["topology.kubernetes.io/zone"] = "z1"
    spawner.load_state(suspended_state(info))
    await start_with_progress(spawner)
    pod = kube.created[0]
    exprs = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"][0]["matchExpressions"]
    assert {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["z1"]} in exprs
    assert {"key": "nvidia.com/gpu.product", "operator": "In", "values": [H100]} in exprs
    assert container(pod)["resources"]["limits"]["nvidia.com/gpu"] == "1"


async def test_runtime_restore_uses_checkpoint_image(kube, agent):
    info = checkpoint(gpu_model="", gpu_count=0, image_bytes=90 * 1024**2)
    spawner = make_spawner(kube, agent, restore_mode="runtime", extra_resource_limits={})
    spawner.load_state(suspended_state(info))
    # the runtime (CRI-O) brings the container back; its server answers on the pod port
    restored = await serve_notebook_api(spawner.port)
    try:
        url, events = await start_with_progress(spawner)
    finally:
        restored.stop()
    pod = kube.created[0]
    c = container(pod)
    assert c["image"] == info["id"]
    assert "command" not in c and c["args"][0] == "jupyterhub-singleuser"
    assert pod["metadata"]["annotations"][RESTORED_FROM_ANNOTATION] == info["id"]
    assert PLACEHOLDER_ANNOTATION not in pod["metadata"]["annotations"]
    assert not [r for r in agent.requests if r[1] == "/v1/restore"]
    assert spawner.api_token == "old-token-held-by-the-processes"
    assert url == f"http://127.0.0.1:{spawner.port}"


async def test_failed_agent_restore_falls_back_to_fresh_server(kube, agent, caplog):
    caplog.set_level(logging.INFO)
    info = checkpoint()
    agent.restore_error = {
        "error": "criu restore failed: Can't fork for 31: File exists",
        "fix": "free the PIDs on the node",
    }
    spawner = make_spawner(kube, agent)
    spawner.load_state(suspended_state(info))

    url, events = await start_with_progress(spawner)

    # placeholder created, deleted; then a normal pod
    assert [container(p).get("command") for p in kube.created] == [["sleep", "infinity"], None]
    assert container(kube.created[1])["args"][0] == "jupyterhub-singleuser"
    fresh = kube.pods["jhub/jupyter-alice"]
    assert PLACEHOLDER_ANNOTATION not in (fresh["metadata"].get("annotations") or {})
    assert "affinity" not in fresh["spec"] or not fresh["spec"]["affinity"].get("nodeAffinity")
    assert url == f"http://127.0.0.1:{spawner.port}"
    # the Hub's fresh token stays: the old one is only reused after a successful restore
    assert spawner.api_token == "fresh-token-from-hub"
    assert spawner.will_resume is False
    state = spawner.get_state()["gpusnap"]
    assert "checkpoint" not in state
    assert state["failures"][-1]["id"] == info["id"]
    assert "Can't fork" in state["failures"][-1]["error"]
    messages = " ".join(e["message"] for e in events)
    assert "Could not restore your snapshot" in messages and "Can't fork" in messages
    assert "free the PIDs on the node" in messages
    assert "alice/: restore of checkpoint" in caplog.text and "Can't fork" in caplog.text


async def test_no_node_with_same_gpu_model_falls_back(kube, agent):
    info = checkpoint(gpu_model="NVIDIA-B200", gpu_count=1)
    spawner = make_spawner(kube, agent, restore_timeout=1.5)
    spawner.load_state(suspended_state(info))
    url, events = await start_with_progress(spawner)
    assert len(kube.created) == 2
    placeholder, fresh = kube.created
    assert placeholder["metadata"]["annotations"][PLACEHOLDER_ANNOTATION] == info["id"]
    assert kube.pods["jhub/jupyter-alice"]["spec"]["nodeName"] in ("gpu-a100", "gpu-h100")
    assert not [r for r in agent.requests if r[1] == "/v1/restore"]
    messages = " ".join(e["message"] for e in events)
    assert "NVIDIA-B200" in messages
    assert "did not finish within 1.5s" in messages


async def test_no_agent_on_the_node_falls_back_with_fix(kube, agent):
    del kube.pods["gpusnap-system/gpusnap-agent-gpu-h100"]
    spawner = make_spawner(kube, agent)
    spawner.load_state(suspended_state(checkpoint()))
    url, events = await start_with_progress(spawner)
    messages = " ".join(e["message"] for e in events)
    assert "no gpusnap node agent pod runs on node gpu-h100" in messages
    assert "Deploy the agent DaemonSet" in messages
    # the lookup asked for agent pods on that node only
    lookups = [
        u for m, u, b in kube.requests if u.startswith("/api/v1/namespaces/gpusnap-system/pods")
    ]
    assert lookups and all("fieldSelector=spec.nodeName%3Dgpu-h100" in u for u in lookups)
    assert "command" not in container(kube.pods["jhub/jupyter-alice"])


async def test_agent_unreachable_falls_back_with_fix(kube, agent):
    info = checkpoint()
    spawner = make_spawner(kube, agent, agent_port=free_port())
    spawner.load_state(suspended_state(info))
    url, events = await start_with_progress(spawner)
    messages = " ".join(e["message"] for e in events)
    assert "node agent" in messages and "DaemonSet" in messages
    assert spawner.api_token == "fresh-token-from-hub"
    assert "command" not in container(kube.pods["jhub/jupyter-alice"])


async def test_stop_finds_checkpoint_through_kubernetes_backend(kube, tmp_path):
    """The service's KubernetesBackend records checkpoints in ConfigMaps; stop() finds the new one."""
    from jupyterhub_gpusnap.checkpoint.base import CheckpointInfo
    from jupyterhub_gpusnap.checkpoint.kubernetes import KubernetesBackend

    token_file = tmp_path / "sa-token"
    token_file.write_text("kube-token\n")
    spawner = make_spawner(kube, checkpoint_backend_class=KubernetesBackend)
    spawner.config.KubeAPI.api_url = kube.url
    spawner.config.KubeAPI.token_file = str(token_file)
    spawner.config.AgentLocator.namespace = "jhub"
    await spawner.start()
    assert kube.pods["jhub/jupyter-alice"]["spec"]["nodeName"] == "gpu-a100"
    started = time.time() - 60
    spawner.orm_spawner.started = datetime.fromtimestamp(started, timezone.utc).replace(tzinfo=None)

    backend = KubernetesBackend(config=spawner.config)
    for created, digest in (
        (started - 3600, "11"),
        (started + 30, "22"),
    ):  # an older run's, then this run's
        info = CheckpointInfo(
            id=f"registry.example.org/gpusnap/alice-default@sha256:{digest * 32}",
            user="alice",
            server_name="",
            created=created,
            status="verified",
            image_bytes=3 * 1024**3,
        )
        cm = backend._configmap(info)
        cm["metadata"]["namespace"] = "jhub"
        kubernetes_validate.validate(cm, K8S_VERSION, strict=True)
        kube.configmaps.append(cm)

    await spawner.stop()
    spawner.clear_state()
    pending = spawner.pending_checkpoint
    assert pending["id"].endswith("22" * 32)
    # what the checkpoint ran on, for the restore's placement: the node's GPU model, the pod's GPU count
    assert pending["gpu_model"] == A100 and pending["gpu_count"] == 1
    assert spawner.will_resume is True
    lists = [u for m, u, b in kube.requests if u.startswith("/api/v1/namespaces/jhub/configmaps")]
    assert lists and "labelSelector=" in lists[0]


async def test_stop_ignores_checkpoint_of_an_earlier_run(kube, tmp_path):
    from jupyterhub_gpusnap.checkpoint.base import CheckpointInfo
    from jupyterhub_gpusnap.checkpoint.kubernetes import KubernetesBackend

    token_file = tmp_path / "sa-token"
    token_file.write_text("kube-token\n")
    spawner = make_spawner(kube, checkpoint_backend_class=KubernetesBackend)
    spawner.config.KubeAPI.api_url = kube.url
    spawner.config.KubeAPI.token_file = str(token_file)
    spawner.config.AgentLocator.namespace = "jhub"
    await spawner.start()
    spawner.orm_spawner.started = datetime.now(timezone.utc).replace(tzinfo=None)
    backend = KubernetesBackend(config=spawner.config)
    cm = backend._configmap(
        CheckpointInfo(
            id="registry.example.org/gpusnap/alice-default@sha256:" + "33" * 32,
            user="alice",
            server_name="",
            created=time.time() - 86400,
            status="verified",
        )
    )
    cm["metadata"]["namespace"] = "jhub"
    kube.configmaps.append(cm)
    await spawner.stop()
    assert spawner.pending_checkpoint is None
    assert spawner.will_resume is False


async def test_stop_ignores_a_checkpoint_the_server_outlived(kube, caplog):
    """A checkpoint of this run, but an hour old: the user kept working after it."""
    spawner = make_spawner(kube, checkpoint_max_age=1800)
    await spawner.start()
    spawner.orm_spawner.started = datetime.now(timezone.utc).replace(tzinfo=None) - timedelta(
        hours=2
    )
    kube.pods["jhub/jupyter-alice"]["metadata"].setdefault("annotations", {})[
        CHECKPOINT_ANNOTATION
    ] = json.dumps(checkpoint(created=time.time() - 3600))
    await spawner.stop()
    assert spawner.pending_checkpoint is None
    assert spawner.will_resume is False
    assert "more than checkpoint_max_age" in caplog.text


async def test_agent_token_from_file(kube, agent, tmp_path):
    token_file = tmp_path / "agent-token"
    token_file.write_text(agent.token + "\n")
    spawner = make_spawner(kube, agent, agent_api_token="", agent_token_file=str(token_file))
    spawner.load_state(suspended_state(checkpoint()))
    url, events = await start_with_progress(spawner)
    assert events[-1]["message"] == "Server restored from its snapshot."
    assert spawner.api_token == "old-token-held-by-the-processes"


async def test_missing_agent_token_falls_back_and_names_the_setting(kube, agent, tmp_path):
    spawner = make_spawner(
        kube, agent, agent_api_token="", agent_token_file=str(tmp_path / "absent")
    )
    spawner.load_state(suspended_state(checkpoint()))
    url, events = await start_with_progress(spawner)
    messages = " ".join(e["message"] for e in events)
    assert "no token for the node agent" in messages and "agent_api_token" in messages
    assert not [r for r in agent.requests if r[1] == "/v1/restore"]
