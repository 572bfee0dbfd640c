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

Kubelet: ``POST /checkpoint/{ns}/{pod}/{container}?timeout=`` dumps the pod's real
local process with CRIU (``--leave-running``: the container keeps running, as with
the real kubelet), lays the archive out like the kubelet's (``config.dump spec.dump
checkpoint/ rootfs-diff.tar dump.log stats-dump``) under a folder standing for
``/var/lib/kubelet/checkpoints`` and answers ``{"items": ["/var/lib/kubelet/checkpoints/…tar"]}``.
``kubelet_mode`` switches it to a failure: ``gate-off`` (404, as with the
ContainerCheckpoint gate off or an unparsable timeout), ``error`` (500 from the
runtime), ``hang`` (no answer), ``forbidden`` (403 for ``nodes/checkpoint``).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import uuid
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import referencing
from ports import free_port
from tornado import web
from tornado.httpserver import HTTPServer

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


# -- local stand-ins for containers -----------------------------------------------------

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
    """A real local process standing for a container: it keeps a random secret in memory
    and appends ``<secret> <counter>`` to a log every 50 ms, so a restored copy is
    recognisable (same secret, counter going on) and a fresh one is not."""

    def __init__(self, folder: Path, ballast: int = 1 << 20):
        self.log = Path(folder) / "workload.log"
        self.ballast = ballast
        self.proc: subprocess.Popen | None = None

    def start(self) -> Workload:
        self.proc = subprocess.Popen(
            [sys.executable, "-S", "-c", WORKLOAD, str(self.log), str(self.ballast)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            cwd=str(self.log.parent),
        )
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

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
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()


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


class FakeKube:
    """The API server and one kubelet per call to :meth:`add_node`, all on localhost."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.checkpoints = (
            self.root / "kubelet-checkpoints"
        )  # stands for /var/lib/kubelet/checkpoints
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        self.pods: dict[tuple[str, str], dict] = {}
        self.nodes: dict[str, dict] = {}
        self.configmaps: dict[tuple[str, str], dict] = {}
        self.workloads: dict[tuple[str, str], Workload] = {}
        self.tokens: dict[str, str] = {}  # bearer token -> username
        self.forbidden: set[str] = set()  # resources (e.g. "nodes/checkpoint") RBAC denies
        self.kubelet_mode = "ok"
        self.requests: list[tuple[str, str]] = []
        self.deleted: list[str] = []
        self.checkpointed: list[str] = []
        self._hang = asyncio.Event()
        self._rv = 1000
        self.servers: list[HTTPServer] = []
        self.api_port = free_port()
        self.kubelet_port = free_port()

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def add_token(self, username: str) -> str:
        token = f"sa-{uuid.uuid4().hex}"
        self.tokens[token] = username
        return token

    def forbid(self, resource: str) -> None:
        self.forbidden.add(resource)

    def next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    async def start(self) -> FakeKube:
        api = web.Application(
            [
                (
                    r"/api/v1/nodes/([^/]+)/proxy/checkpoint/([^/]+)/([^/]+)/([^/]+)",
                    ProxyCheckpointHandler,
                ),
                (r"/api/v1/nodes/([^/]+)", NodeHandler),
                (r"/api/v1/pods", PodListHandler),
                (r"/api/v1/namespaces/([^/]+)/pods", PodListHandler),
                (r"/api/v1/namespaces/([^/]+)/pods/([^/]+)", PodHandler),
                (r"/api/v1/namespaces/([^/]+)/configmaps", ConfigMapListHandler),
                (r"/api/v1/namespaces/([^/]+)/configmaps/([^/]+)", ConfigMapHandler),
                (r"/apis/authentication.k8s.io/v1/tokenreviews", TokenReviewHandler),
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
        for app, port in ((api, self.api_port), (kubelet, self.kubelet_port)):
            server = HTTPServer(app)
            server.listen(port, "127.0.0.1")
            self.servers.append(server)
        return self

    async def stop(self) -> None:
        self._hang.set()
        for server in self.servers:
            server.stop()
            await server.close_all_connections()
        for w in self.workloads.values():
            w.stop()

    def add_node(self, name: str) -> dict:
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "uid": str(uuid.uuid4()),
                "resourceVersion": self.next_rv(),
                "creationTimestamp": rfc3339(),
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "nvidia.com/gpu.present": "true",
                },
            },
            "spec": {},
            "status": {
                "addresses": [
                    {"type": "InternalIP", "address": "127.0.0.1"},
                    {"type": "Hostname", "address": name},
                ],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": self.kubelet_port}},
                "capacity": {"cpu": "2", "memory": "8Gi", "nvidia.com/gpu": "1", "pods": "110"},
                "allocatable": {"cpu": "2", "memory": "8Gi", "nvidia.com/gpu": "1", "pods": "110"},
                "nodeInfo": {
                    "architecture": "amd64",
                    "bootID": str(uuid.uuid4()),
                    "containerRuntimeVersion": "containerd://2.1.4",
                    "kernelVersion": "6.18.0",
                    "kubeProxyVersion": "",
                    "kubeletVersion": "v1.34.1",
                    "machineID": uuid.uuid4().hex,
                    "operatingSystem": "linux",
                    "osImage": "Debian GNU/Linux 12 (bookworm)",
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
        self.nodes[name] = validate(node)
        return node

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
    ) -> dict:
        """Add a running pod; ``workload`` is the local process its container stands for."""
        cid = uuid.uuid4().hex + uuid.uuid4().hex
        resources = {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {}
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": str(uuid.uuid4()),
                "resourceVersion": self.next_rv(),
                "creationTimestamp": rfc3339(),
                "labels": dict(labels or {}),
                "annotations": dict(annotations or {}),
            },
            "spec": {
                "nodeName": node,
                "serviceAccountName": "default",
                "restartPolicy": "OnFailure",
                "containers": [
                    {
                        "name": container,
                        "image": "quay.io/jupyter/pytorch-notebook:cuda12-2026-11-01",
                        "ports": [
                            {"containerPort": 8888, "name": "notebook-port", "protocol": "TCP"}
                        ],
                        "resources": resources,
                    }
                ],
            },
            "status": {
                "phase": "Running",
                "hostIP": "127.0.0.1",
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
                        "containerID": f"containerd://{cid}",
                        "state": {"running": {"startedAt": rfc3339()}},
                    }
                ],
            },
        }
        self.pods[(namespace, name)] = validate(pod)
        if workload is not None:
            self.workloads[(namespace, name)] = workload
        return pod

    # -- the kubelet's checkpoint ---------------------------------------------------------

    async def kubelet_checkpoint(self, namespace: str, name: str, container: str) -> str:
        """Dump the pod's workload with CRIU and write a kubelet-style archive; return its host path."""
        pod = self.pods[(namespace, name)]
        workload = self.workloads[(namespace, name)]
        stamp = rfc3339()
        base = f"checkpoint-{name}_{namespace}-{container}-{stamp}"
        work = self.root / "kubelet-work" / base
        images = work / "checkpoint"
        images.mkdir(parents=True)
        proc = await asyncio.create_subprocess_exec(
            CRIU,
            "dump",
            "-t",
            str(workload.pid),
            "-D",
            str(images),
            "--leave-running",
            "-o",
            "dump.log",
            "-v4",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(
                f"criu dump failed: {err.decode()} {(images / 'dump.log').read_text()[-2000:]}"
            )
        shutil.move(images / "dump.log", work / "dump.log")
        shutil.copy(images / "stats-dump", work / "stats-dump")
        (work / "config.dump").write_text(
            json.dumps(
                {
                    "id": pod["status"]["containerStatuses"][0]["containerID"].split("://")[1],
                    "name": container,
                    "rootfsImage": pod["spec"]["containers"][0]["image"],
                    "rootfsImageRef": pod["status"]["containerStatuses"][0]["imageID"],
                    "rootfsImageName": pod["spec"]["containers"][0]["image"],
                    "runtime": "io.containerd.runc.v2",
                    "createdTime": stamp,
                    "checkpointedTime": stamp,
                }
            )
        )
        (work / "spec.dump").write_text(
            json.dumps(
                {
                    "ociVersion": "1.2.0",
                    "process": {"args": ["jupyterhub-singleuser"], "cwd": "/home/jovyan"},
                    "root": {"path": "rootfs"},
                    "annotations": {
                        "io.kubernetes.pod.name": name,
                        "io.kubernetes.pod.namespace": namespace,
                        "io.kubernetes.container.name": container,
                        "io.kubernetes.pod.uid": pod["metadata"]["uid"],
                    },
                }
            )
        )
        with tarfile.open(work / "rootfs-diff.tar", "w"):
            pass
        archive = self.checkpoints / f"{base}.tar"
        with tarfile.open(archive, "w") as tar:
            for entry in (
                "config.dump",
                "spec.dump",
                "checkpoint",
                "rootfs-diff.tar",
                "dump.log",
                "stats-dump",
            ):
                tar.add(work / entry, arcname=entry)
        os.chmod(archive, 0o600)
        shutil.rmtree(work)
        self.checkpointed.append(f"{namespace}/{name}/{container}")
        return f"{KUBELET_DIR}/{base}.tar"


class FakeHandler(web.RequestHandler):
    @property
    def kube(self) -> FakeKube:
        return self.settings["kube"]

    def prepare(self) -> None:
        self.kube.requests.append((self.request.method, self.request.uri))

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

    def delete(self, namespace: str, name: str) -> None:
        if not self.authorize("delete", "pods", name, namespace):
            return
        pod = self.kube.pods.pop((namespace, name), None)
        if pod is None:
            return self.fail(
                404, "NotFound", f'pods "{name}" not found', {"name": name, "kind": "pods"}
            )
        self.kube.deleted.append(f"{namespace}/{name}")
        self.send_json(pod)


class PodListHandler(FakeHandler):
    def get(self, namespace: str | None = None) -> None:
        if not self.authorize("list", "pods", "", namespace or ""):
            return
        labels = self.get_argument("labelSelector", "")
        fields = self.get_argument("fieldSelector", "")
        items = [
            p
            for (ns, _), p in sorted(self.kube.pods.items())
            if (namespace is None or ns == namespace)
            and match_labels(p["metadata"].get("labels") or {}, labels)
            and match_fields(p, fields)
        ]
        self.send_json(
            {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": self.kube.next_rv()},
                "items": items,
            }
        )


class ConfigMapListHandler(FakeHandler):
    def get(self, namespace: str) -> None:
        if not self.authorize("list", "configmaps", "", namespace):
            return
        labels = self.get_argument("labelSelector", "")
        items = [
            c
            for (ns, _), c in sorted(self.kube.configmaps.items())
            if ns == namespace and match_labels(c["metadata"].get("labels") or {}, labels)
        ]
        self.send_json(
            {
                "kind": "ConfigMapList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": self.kube.next_rv()},
                "items": items,
            }
        )

    def post(self, namespace: str) -> None:
        body = json.loads(self.request.body)
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
    path = await kube.kubelet_checkpoint(namespace, pod, container)
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

    async def start(self, **agent_config) -> Cluster:
        from traitlets.config import Config

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
        c = Config()
        c.AgentApp.node_name = NODE
        c.AgentApp.ip = "127.0.0.1"
        c.AgentApp.port = 0
        c.AgentApp.api_token_file = str(self.secret_file)
        c.AgentApp.checkpoint_dir = str(self.kube.checkpoints)
        c.AgentApp.restore_dir = str(self.root / "restore")
        c.AgentApp.criu_path = CRIU
        c.AgentApp.cpu_sample_seconds = 0.01
        c.KubeAPI.api_url = self.kube.api_url
        c.KubeAPI.token_file = str(self.agent_token_file)
        c.KubeletClient.kubelet_scheme = "http"
        c.KubeletClient.timeout_grace = 0.5
        c.Shipper.registry_scheme = "http"
        c.Shipper.chunk_size = 1 << 20
        c.PodMapper.proc_root = str(self.tree.proc)
        c.PodMapper.cgroup_root = str(self.tree.cgroup)
        for key, value in agent_config.items():
            section, _, name = key.partition("__")
            setattr(c[section], name, value)
        self.agent = AgentApp(config=c)
        await self.agent.start_server()
        self.kube.add_pod(
            "gpusnap",
            "gpusnap-agent-x7k2p",
            NODE,
            container="agent",
            labels={"app.kubernetes.io/name": "jupyterhub-gpusnap-agent"},
            gpus=0,
        )
        return self

    @property
    def agent_url(self) -> str:
        return f"http://127.0.0.1:{self.agent.port}"

    def hub_config(self, **extra):
        """Config for the hub side (KubernetesBackend, AgentSignal) pointing at this cluster."""
        from traitlets.config import Config

        c = Config()
        c.AgentLocator.namespace = "jhub"
        c.AgentLocator.agent_namespace = "gpusnap"
        c.AgentLocator.agent_port = self.agent.port
        c.AgentLocator.agent_token_file = str(self.secret_file)
        c.KubeAPI.api_url = self.kube.api_url
        c.KubeAPI.token_file = str(self.hub_token_file)
        for key, value in extra.items():
            section, _, name = key.partition("__")
            setattr(c[section], name, value)
        return c

    def add_user_pod(self, user: str, workload: Workload | None = None, name: str = "") -> dict:
        pod = f"jupyter-{user}" + (f"--{name}" if name else "")
        return self.kube.add_pod(
            "jhub",
            pod,
            NODE,
            workload=workload,
            labels={"component": "singleuser-server", "hub.jupyter.org/username": user},
            annotations={"hub.jupyter.org/username": user, "hub.jupyter.org/servername": name},
        )

    async def stop(self) -> None:
        if self.agent is not None:
            await self.agent.stop_server()
        await self.kube.stop()
