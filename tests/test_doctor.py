"""`jupyterhub-gpusnap doctor` against the wire-level fake API server and node agents.

Each GPU node's agent is a real HTTP server on that node's InternalIP (loopback
addresses 127.0.0.x), following the agent contract; the registry is a real HTTP
server answering the distribution API's ``GET /v2/`` like a registry asking for auth.
"""

from __future__ import annotations

import json

import pytest
import tornado.web
from tornado.httpserver import HTTPServer
from traitlets.config import Config

from jupyterhub_gpusnap.doctor import RBAC_NEEDS, Doctor, DoctorApp, format_table, runtime_check
from jupyterhub_gpusnap.kube.agent import AgentConnection
from tests.helpers.fake_kube import A100, H100, FakeAgent, fake_cluster, free_port, make_node

pytestmark = pytest.mark.k8s

ALL_RBAC = [(verb, group, res, sub) for verb, group, res, sub, _, _ in RBAC_NEEDS]


class V2(tornado.web.RequestHandler):
    def get(self):
        self.set_status(401)
        self.set_header("Docker-Distribution-API-Version", "registry/2.0")
        self.set_header(
            "WWW-Authenticate", 'Bearer realm="https://auth.example.org/token",service="registry"'
        )
        self.finish({"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]})


@pytest.fixture
async def kube(tmp_path, monkeypatch):
    async with fake_cluster(tmp_path, monkeypatch) as fake:
        yield fake


@pytest.fixture
async def registry():
    port = free_port()
    server = HTTPServer(tornado.web.Application([(r"/v2/", V2)]))
    server.listen(port, "127.0.0.1")
    yield f"127.0.0.1:{port}/gpusnap"
    server.stop()
    await server.close_all_connections()


@pytest.fixture
async def cluster(kube):
    """Two GPU nodes (CRI-O H100, containerd 2.2 A100), each with its agent."""
    kube.nodes.clear()
    kube.add_node(make_node("cpu-1", ip="127.0.0.1"))
    kube.add_node(make_node("gpu-h100", H100, 2, runtime="cri-o://1.33.2", ip="127.0.0.2"))
    kube.add_node(make_node("gpu-a100", A100, 4, runtime="containerd://2.2.1", ip="127.0.0.3"))
    kube.allow(("get", "", "nodes", "proxy"), *ALL_RBAC)
    port = free_port()
    agents = {}
    for node, ip in (("gpu-h100", "127.0.0.2"), ("gpu-a100", "127.0.0.3")):
        a = await FakeAgent(kube, host=ip, port=port).start()
        a.health = {"ok": True, "node": node, "criu": "4.2.1", "driver": "580.159.04"}
        kube.add_agent_pod(node, ip)
        a.doctor_checks = [
            {"name": "kubelet-checkpoint-gate", "ok": True, "detail": "enabled", "fix": ""},
            {
                "name": "checkpoint-dir",
                "ok": True,
                "detail": "/var/lib/kubelet/checkpoints writable",
                "fix": "",
            },
            {"name": "nvidia-driver", "ok": True, "detail": "580.159.04", "fix": ""},
        ]
        agents[node] = a
    yield kube, agents, port
    for a in agents.values():
        await a.stop()


def doctor_config(kube, port, **over) -> dict:
    cfg = dict(
        namespace="jhub",
        kubeconfig=kube.kubeconfig_path,
        agent_port=port,
        agent_api_token="agent-secret",
    )
    cfg.update(over)
    # the agent settings are AgentConnection's, the rest Doctor's
    c = Config()
    for k, v in cfg.items():
        setattr(c.AgentConnection if k in AgentConnection.class_own_traits() else c.Doctor, k, v)
    return {"config": c}


@pytest.fixture
def kubeconfig(kube, tmp_path):
    kube.kubeconfig_path = kube.kubeconfig(tmp_path / "doctor-kubeconfig")
    return kube.kubeconfig_path


def by_name(checks):
    return {c.name: c for c in checks}


async def test_ready_cluster_all_ok_through_the_cli(cluster, kubeconfig, registry, capsys):
    kube, agents, port = cluster
    app = DoctorApp()
    app.initialize(
        [
            "--namespace=jhub",
            f"--kubeconfig={kubeconfig}",
            f"--registry={registry}",
            "--registry-insecure",
            f"--agent-url=http://{{host_ip}}:{port}",
            "--agent-token=agent-secret",
        ]
    )
    status = await app.run()
    out = capsys.readouterr().out
    assert status == 0, out
    checks = by_name(app.checks)
    assert all(c.status == "ok" for c in app.checks), out
    assert checks["kubernetes-version"].detail == "API server v1.33.4"
    assert (
        "gpu-h100, gpu-a100" in checks["gpu-nodes"].detail
        or "gpu-a100, gpu-h100" in checks["gpu-nodes"].detail
    )
    assert "CRI-O 1.33.2" in checks["gpu-h100: container-runtime"].detail
    assert "containerd 2.2.1" in checks["gpu-a100: container-runtime"].detail
    assert checks["gpu-h100: criu"].detail == "CRIU 4.2.1"
    assert checks["gpu-a100: nvidia-driver"].detail == "driver 580.159.04"
    assert checks["gpu-h100: checkpoint-dir"].status == "ok"
    assert [c.name for c in app.checks].count("gpu-h100: nvidia-driver") == 1
    assert "kubelet /configz" in checks["gpu-h100: kubelet-checkpoint-gate"].detail
    assert "(401)" in checks["registry"].detail
    assert checks["rbac: list pods in gpusnap-system"].status == "ok"
    assert "cpu-1: container-runtime" not in checks  # CPU-only nodes are not checked
    assert "ready: every check passed" in out
    # the agent was asked with the bearer token, on its node's address
    assert ("GET", "/v1/doctor", None) in agents["gpu-h100"].requests
    # SelfSubjectAccessReviews went out for every need, with the namespace where it applies
    reviews = [b for m, u, b in kube.requests if u.startswith("/apis/authorization.k8s.io")]
    assert len(reviews) == len(RBAC_NEEDS)
    assert {"verb": "create", "resource": "configmaps", "namespace": "jhub"} in [
        r["spec"]["resourceAttributes"] for r in reviews
    ]
    assert {"verb": "get", "resource": "nodes"} in [
        r["spec"]["resourceAttributes"] for r in reviews
    ]


async def test_broken_cluster_says_what_to_fix(cluster, kubeconfig, capsys):
    kube, agents, port = cluster
    kube.version = "v1.29.3"
    kube.allowed.discard(("get", "", "nodes", "proxy"))  # configz not readable: gate from the agent
    kube.allowed.discard(("create", "", "configmaps", ""))
    h100 = kube.nodes["gpu-h100"]
    h100["status"]["nodeInfo"]["kubeletVersion"] = "v1.29.3"
    del h100["metadata"]["labels"]["nvidia.com/gpu.product"]
    kube.nodes["gpu-a100"]["status"]["nodeInfo"]["containerRuntimeVersion"] = "containerd://2.4.0"
    agents["gpu-h100"].health["criu"] = "4.1.1"
    agents["gpu-h100"].doctor_checks[0] = {
        "name": "kubelet-checkpoint-gate",
        "ok": False,
        "detail": "featureGates.ContainerCheckpoint=false in /var/lib/kubelet/config.yaml",
        "fix": "set ContainerCheckpoint: true and restart the kubelet",
    }
    agents["gpu-a100"].health["driver"] = "550.54.15"
    agents["gpu-a100"].doctor_checks[-1] = {
        "name": "nvidia-driver",
        "ok": False,
        "detail": "550.54.15: cuCheckpointProcessLock missing",
        "fix": "NVIDIA driver >= 570 provides cuCheckpointProcess*",
    }

    checks = await Doctor(
        **doctor_config(kube, port, restore_mode="runtime", pvc="snapshots")
    ).run()
    c = by_name(checks)
    text = format_table(checks)

    assert c["kubernetes-version"].status == "fail"
    assert "ContainerCheckpoint" in c["kubernetes-version"].fix
    assert c["gpu-h100: kubelet-version"].status == "fail"
    assert c["gpu-h100: gpu-model"].status == "fail"
    assert "kubectl label node gpu-h100 nvidia.com/gpu.product=" in c["gpu-h100: gpu-model"].fix
    gate = c["gpu-h100: kubelet-checkpoint-gate"]
    assert gate.status == "fail" and gate.detail.startswith("via the node agent")
    assert "restart the kubelet" in gate.fix
    assert c["gpu-h100: criu"].status == "fail" and "4.2" in c["gpu-h100: criu"].fix
    assert c["gpu-a100: container-runtime"].status == "fail"
    assert "restore_mode = 'agent'" in c["gpu-a100: container-runtime"].fix
    driver = c["gpu-a100: nvidia-driver"]  # the agent's own, more specific check replaces ours
    assert driver.status == "fail" and "cuCheckpointProcessLock missing" in driver.detail
    assert ">= 570" in driver.fix
    assert [x.name for x in checks].count("gpu-a100: nvidia-driver") == 1
    assert c["pvc"].status == "fail" and "create the PVC snapshots" in c["pvc"].fix
    assert c["rbac: create configmaps in jhub"].status == "fail"
    assert (
        "Role in jhub (helm-values/agent/rbac-hub.yaml)" in c["rbac: create configmaps in jhub"].fix
    )
    assert c["rbac: create pods in jhub"].status == "ok"
    assert "fix: set c.SnapKubeSpawner.restore_mode = 'agent'" in text
    assert "not ready:" in text


async def test_agent_missing_and_gate_unknown(cluster, kubeconfig):
    kube, agents, port = cluster
    kube.allowed.discard(("get", "", "nodes", "proxy"))
    del kube.pods[("gpusnap-system", "gpusnap-agent-gpu-a100")]
    checks = by_name(
        await Doctor(
            **doctor_config(kube, port, registry="127.0.0.1:1/x", registry_insecure=True)
        ).run()
    )
    agent = checks["gpu-a100: node-agent"]
    assert agent.status == "fail" and "DaemonSet" in agent.fix
    assert "no node agent pod on gpu-a100" in agent.detail
    gate = checks["gpu-a100: kubelet-checkpoint-gate"]
    assert gate.status == "warn" and "nodes/proxy" in gate.fix
    assert checks["gpu-h100: node-agent"].status == "ok"
    assert checks["registry"].status == "fail"


async def test_wrong_agent_token_names_the_secret(cluster, kubeconfig):
    kube, agents, port = cluster
    checks = by_name(
        await Doctor(**doctor_config(kube, port, agent_api_token="wrong", pvc="s")).run()
    )
    assert checks["gpu-h100: node-agent"].status == "fail"
    assert "GPUSNAP_AGENT_TOKEN" in checks["gpu-h100: node-agent"].fix


async def test_no_gpu_nodes_and_bound_pvc(kube, kubeconfig):
    kube.nodes.clear()
    kube.add_node(make_node("cpu-1"))
    kube.allow(*ALL_RBAC)
    kube.pvcs["jhub/snapshots"] = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "snapshots", "namespace": "jhub"},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Ti"}}},
        "status": {"phase": "Bound"},
    }
    checks = by_name(await Doctor(namespace="jhub", kubeconfig=kubeconfig, pvc="snapshots").run())
    assert checks["gpu-nodes"].status == "fail" and "GPU Operator" in checks["gpu-nodes"].fix
    assert checks["pvc"].status == "ok"
    assert "checkpoint-storage" not in checks


async def test_json_output(cluster, kubeconfig, registry, capsys):
    kube, agents, port = cluster
    app = DoctorApp()
    app.initialize(
        [
            f"--kubeconfig={kubeconfig}",
            "--json",
            "--namespace=jhub",
            "--agent-token=agent-secret",
            f"--agent-port={port}",
            f"--registry={registry}",
            "--registry-insecure",
        ]
    )
    assert await app.run() == 0
    data = json.loads(capsys.readouterr().out)
    assert {"name", "status", "ok", "detail", "fix"} <= set(data["checks"][0])
    assert all(c["ok"] for c in data["checks"])


def test_runtime_versions():
    assert runtime_check("cri-o://1.24.0", "agent").status == "fail"
    assert runtime_check("containerd://2.3.9", "runtime").status == "ok"
    assert runtime_check("containerd://2.0.4", "agent").status == "ok"
    assert runtime_check("containerd://2.0.4", "runtime").status == "fail"
    assert runtime_check("docker://27.1.0", "agent").status == "fail"
