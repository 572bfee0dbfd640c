"""The node agent, the kubernetes backend and the agent signal against the wire-level fake cluster.

The API server and kubelet are fakes (real HTTP, exact paths and payloads, schema-checked);
the agent, CRIU, the registry (Debian's docker-registry) and the workload processes are real.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
from pathlib import Path

import jsonschema
import pytest
from tornado.httpclient import AsyncHTTPClient

from jupyterhub_gpusnap.agent.pods import CpuMeter, container_id, parse_cgroup, parse_cpu_stat
from jupyterhub_gpusnap.checkpoint import CheckpointError, CheckpointRefused
from jupyterhub_gpusnap.checkpoint.base import RestoreTarget
from jupyterhub_gpusnap.checkpoint.kubernetes import KubernetesBackend
from jupyterhub_gpusnap.gpu.cuda import CudaCheckpoint
from jupyterhub_gpusnap.gpu.nvml import Nvml
from jupyterhub_gpusnap.model import Server, State
from jupyterhub_gpusnap.policy import Policy, Rule, ServerStatus
from jupyterhub_gpusnap.signals.agent import AgentSignal
from jupyterhub_gpusnap.store import Store
from jupyterhub_gpusnap.watcher import Watcher
from tests.helpers.fake_gpu import CHECKPOINTED, RUNNING, FakeLibcuda, FakeNvmlLib
from tests.helpers.fake_kube import (
    AGENT_SECRET,
    NODE,
    Cluster,
    Workload,
    cgroup2_mount,
    free_port,
    validate,
)
from tests.helpers.registry import Registry

pytestmark = pytest.mark.k8s

UID = "8f3c2a1e-5b7d-4c9e-a1f2-3d4e5f6a7b8c"
CID = "4b825dc642cb6eb9a060e54bf8d69288fbee4904" + "0" * 24


@pytest.fixture
async def cluster(tmp_path):
    c = Cluster(tmp_path)
    await c.start()
    yield c
    await c.stop()


@pytest.fixture
async def host_cluster(tmp_path):
    """A cluster whose agent reads this machine's real /proc and cgroup v2 tree, so that
    restores go into a real placeholder container (Workload.placeholder)."""
    c = Cluster(tmp_path)
    await c.start(PodMapper__proc_root="/proc", PodMapper__cgroup_root=str(cgroup2_mount()))
    yield c
    await c.stop()


@pytest.fixture
async def registry(tmp_path):
    r = await Registry(tmp_path / "registry").start()
    yield r
    r.stop()


# -- pure parts ---------------------------------------------------------------------------


def test_parse_cgroup_finds_pod_in_every_driver_layout():
    systemd = f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n"
    place = parse_cgroup(systemd)
    assert place.pod_uid == UID
    assert place.container_id == CID
    assert place.pod_cgroup.endswith(f"kubepods-burstable-pod{UID.replace('-', '_')}.slice")

    guaranteed_cgroupfs = f"0::/kubepods/pod{UID}/{CID}\n"
    place = parse_cgroup(guaranteed_cgroupfs)
    assert (place.pod_uid, place.pod_cgroup, place.container_id) == (
        UID,
        f"/kubepods/pod{UID}",
        CID,
    )

    crio = f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID.replace('-', '_')}.slice/crio-{CID}.scope\n"
    assert parse_cgroup(crio).container_id == CID

    v1 = f"12:memory:/kubepods/burstable/pod{UID}/{CID}\n11:cpu,cpuacct:/kubepods/burstable/pod{UID}/{CID}\n"
    assert parse_cgroup(v1).pod_uid == UID

    assert parse_cgroup("0::/system.slice/containerd.service\n") is None
    assert parse_cgroup("0::/user.slice/user-1000.slice/session-3.scope\n") is None


def test_cpu_stat_and_meter_give_percent_of_one_core():
    assert parse_cpu_stat("usage_usec 123456\nuser_usec 100000\nsystem_usec 23456\n") == 123456
    with pytest.raises(ValueError, match="cgroup v2"):
        parse_cpu_stat("nr_periods 0\n")
    meter = CpuMeter()
    assert meter.update("pod", 1_000_000, now=100.0) is None
    assert meter.update("pod", 1_500_000, now=102.0) == pytest.approx(25.0)
    assert meter.update("pod", 3_500_000, now=103.0) == pytest.approx(200.0)  # two cores busy
    assert meter.update("pod", 10, now=104.0) is None  # counter reset: a new cgroup
    meter.forget(set())
    assert meter.update("pod", 20, now=105.0) is None


def test_fake_kube_payloads_are_schema_checked():
    with pytest.raises(jsonschema.ValidationError):
        validate(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "x"},
                "spec": {"containers": [{"name": "c", "imagePullPolicy": "Sometimes", "bogus": 1}]},
            }
        )
    with pytest.raises(jsonschema.ValidationError):
        validate({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": "403"})


# -- the agent's HTTP API ----------------------------------------------------------------


async def test_signals_map_host_pids_to_pods_and_read_cgroup_cpu(cluster):
    pod = cluster.add_user_pod("alice")
    uid = pod["metadata"]["uid"]
    cid = container_id(pod["status"]["containerStatuses"][0]["containerID"])
    cluster.map_process(pod, 4242, usage_usec=7_000_000)
    cluster.map_process(pod, 4250)
    other = cluster.kube.add_pod("jhub", "jupyter-bob", "gpu-node-2")
    ticks = itertools.count(1000.0, 1.0)
    cluster.agent.cpu.clock = lambda: next(ticks)

    code, body = await cluster.agent_call(
        "GET", "/v1/signals?pod=jhub/jupyter-alice&pod=jhub/jupyter-bob"
    )
    assert code == 200
    alice = body["pods"]["jhub/jupyter-alice"]
    assert alice == {
        "cpu_percent": 0.0,
        "gpu_percent": None,
        "gpu_memory_bytes": None,
        "gpu_count": None,
    }
    assert "not on node gpu-node-1" in body["pods"]["jhub/jupyter-bob"]["error"]
    assert other["spec"]["nodeName"] == "gpu-node-2"

    cluster.tree.set_cpu(uid, 7_500_000)  # 0.5 s of CPU over the next one-second tick
    code, body = await cluster.agent_call("GET", "/v1/signals?pod=jhub/jupyter-alice")
    assert body["pods"]["jhub/jupyter-alice"]["cpu_percent"] == pytest.approx(50.0)
    assert (
        "GET",
        f"/api/v1/pods?fieldSelector=spec.nodeName%3D{NODE}",
        None,
    ) in cluster.kube.requests

    mapped = cluster.agent.mapper.scan()
    assert mapped[uid].pids == [4242, 4250]
    assert mapped[uid].containers == {cid: [4242, 4250]}
    assert 1 not in mapped[uid].pids and 812 not in mapped[uid].pids


async def test_api_errors_carry_a_fix(cluster):
    code, body = await cluster.agent_call("GET", "/v1/signals?pod=jhub/jupyter-alice", token="")
    assert code == 401 and body["fix"]
    code, body = await cluster.agent_call("GET", "/healthz", token="wrong")
    assert code == 401 and "api_token_file" in body["fix"]
    code, body = await cluster.agent_call("GET", "/v1/signals?pod=../etc")
    assert code == 400 and "NAMESPACE/POD" in body["fix"]
    code, body = await cluster.agent_call("POST", "/v1/checkpoint", {"namespace": "jhub"})
    assert code == 400 and body["error"] == "missing field 'pod'"
    code, body = await cluster.agent_call(
        "POST", "/v1/park", {"namespace": "jhub", "pod": "jupyter-alice"}
    )
    assert code == 409 and "570" in body["fix"]


async def test_healthz_and_doctor_report_node_facts(cluster):
    code, body = await cluster.agent_call("GET", "/healthz")
    assert code == 200
    assert body == {"ok": True, "node": NODE, "criu": "4.2.1", "driver": None}
    code, body = await cluster.agent_call("GET", "/v1/doctor")
    checks = {c["name"]: c for c in body["checks"]}
    assert checks["criu"]["ok"] and checks["criu"]["detail"] == "criu 4.2.1"
    assert (
        checks["cgroup-v2"]["ok"] and checks["checkpoint-dir"]["ok"] and checks["api-server"]["ok"]
    )
    assert not checks["nvidia-driver"]["ok"] and "NVIDIA driver" in checks["nvidia-driver"]["fix"]
    # the RBAC rules the agent uses, each reviewed with a SelfSubjectAccessReview
    rbac = sorted(name for name in checks if name.startswith("rbac: "))
    assert rbac == [
        "rbac: create nodes/checkpoint",
        "rbac: get nodes",  # this config gives no kubelet_host/kubelet_port
        "rbac: get pods",
        "rbac: list pods",
    ]
    assert all(checks[name]["ok"] for name in rbac)
    reviews = [b for m, u, b in cluster.kube.requests if u.endswith("selfsubjectaccessreviews")]
    assert {"verb": "create", "resource": "nodes", "subresource": "checkpoint"} in [
        r["spec"]["resourceAttributes"] for r in reviews
    ]
    # a rule the ClusterRole lacks fails, naming where to add it
    cluster.kube.forbid("nodes/checkpoint")
    code, body = await cluster.agent_call("GET", "/v1/doctor")
    failed = {c["name"]: c for c in body["checks"]}["rbac: create nodes/checkpoint"]
    assert not failed["ok"] and "helm-values/agent/rbac.yaml" in failed["fix"]
    assert not checks["host-pids"]["ok"] and "hostPID" in checks["host-pids"]["fix"]


async def test_tokenreview_auth_admits_only_allowed_service_accounts(tmp_path):
    cluster = Cluster(tmp_path)
    await cluster.start(
        AgentApp__auth="tokenreview", AgentApp__allowed_users=["system:serviceaccount:jhub:hub"]
    )
    try:
        hub_token = cluster.hub_token_file.read_text()
        code, body = await cluster.agent_call("GET", "/healthz", token=hub_token)
        assert code == 200 and body["ok"]
        other = cluster.kube.add_token("system:serviceaccount:default:default")
        code, body = await cluster.agent_call("GET", "/healthz", token=other)
        assert code == 403 and "allowed_users" in body["fix"]
        code, body = await cluster.agent_call("GET", "/healthz", token="sa-forged")
        assert code == 401
        reviews = [
            r
            for r in cluster.kube.requests
            if r[1].startswith("/apis/authentication.k8s.io/v1/tokenreviews")
        ]
        assert len(reviews) == 3
        await cluster.agent_call("GET", "/healthz", token=hub_token)  # cached: no new review
        assert len([r for r in cluster.kube.requests if "tokenreviews" in r[1]]) == 3

        # the hub side sends its own ServiceAccount token when it has no shared secret
        cluster.add_user_pod("alice")
        source = AgentSignal(config=cluster.hub_config(AgentLocator__agent_token_file=""))
        sample = await source.sample(Server(user="alice"), now=1.0)
        assert "no processes of pod jhub/jupyter-alice" in sample.errors["agent"]

        cluster.kube.forbid("tokenreviews")
        cluster.agent._reviews.clear()
        code, body = await cluster.agent_call("GET", "/healthz", token=hub_token)
        assert code == 403 and "ClusterRole" in body["fix"]
    finally:
        await cluster.stop()


async def test_tokenreview_refusals_are_cached_and_reviews_are_rate_limited(tmp_path):
    """A caller retrying a bad token, or many callers with made-up tokens, cannot make the
    agent load the API server: refusals are remembered, new tokens reviewed at a bounded rate."""
    cluster = Cluster(tmp_path)
    await cluster.start(
        AgentApp__auth="tokenreview",
        AgentApp__allowed_users=["system:serviceaccount:jhub:hub"],
        AgentApp__tokenreview_max_per_second=0.01,  # one review, then one per 100 s
    )

    def reviews() -> int:
        return len([r for r in cluster.kube.requests if "tokenreviews" in r[1]])

    try:
        code, body = await cluster.agent_call("GET", "/healthz", token="sa-forged")
        assert code == 401 and reviews() == 1
        for _ in range(5):  # the same bad token again: refused from memory
            code, again = await cluster.agent_call("GET", "/healthz", token="sa-forged")
            assert code == 401 and again == body
        assert reviews() == 1
        # a token never seen, beyond the rate: 429 without asking the API server
        hub_token = cluster.hub_token_file.read_text()
        code, body = await cluster.agent_call("GET", "/healthz", token=hub_token)
        assert code == 429 and reviews() == 1
        assert "AgentApp.tokenreview_max_per_second" in body["fix"]
        # once the budget allows it, the good token is reviewed and then trusted from memory
        cluster.agent.tokenreview_max_per_second = 0
        for _ in range(3):
            code, body = await cluster.agent_call("GET", "/healthz", token=hub_token)
            assert code == 200
        assert reviews() == 2
    finally:
        await cluster.stop()


async def test_checkpoints_to_a_pvc_need_a_configured_folder(cluster, tmp_path):
    """With pvc_paths empty (the default) no caller can have the agent (root on the node)
    write into a folder it names; with it set, only those folders, however spelled."""
    allowed, other = tmp_path / "snapshots", tmp_path / "etc"
    allowed.mkdir()
    other.mkdir()
    cluster.add_user_pod("alice")
    request = {"namespace": "jhub", "pod": "jupyter-alice", "container": "notebook"}

    code, body = await cluster.agent_call(
        "POST", "/v1/checkpoint", {**request, "target": {"kind": "pvc", "path": str(allowed)}}
    )
    assert code == 403 and "AgentApp.pvc_paths is empty" in body["error"]
    assert "AgentApp.pvc_paths" in body["fix"]
    cluster.agent.pvc_paths = [str(allowed)]
    for path in (other, allowed / ".." / "etc"):
        code, body = await cluster.agent_call(
            "POST", "/v1/checkpoint", {**request, "target": {"kind": "pvc", "path": str(path)}}
        )
        assert code == 403 and "is not one of AgentApp.pvc_paths" in body["error"], path
    # refused before anything was frozen or checkpointed
    assert cluster.kube.checkpointed == [] and list(other.iterdir()) == []


# -- checkpoints through the hub-side backend --------------------------------------------


def alice(name: str = "") -> Server:
    return Server(user="alice", name=name, state={"pod_name": "jupyter-alice", "namespace": "jhub"})


@pytest.mark.criu
async def test_backend_checkpoint_ships_verified_image_and_records_it(
    host_cluster, registry, tmp_path
):
    cluster = host_cluster
    work = Workload(tmp_path).start()
    await work.wait_lines(2)
    cluster.add_user_pod("alice", work)
    backend = KubernetesBackend(
        config=cluster.hub_config(
            KubernetesBackend__repository_template=f"{registry.host}/gpusnap/{{username}}",
            KubernetesBackend__registry_scheme="http",
            KubernetesBackend__timeout=60,
        )
    )

    info = await backend.checkpoint(alice())

    assert info.status == "verified" and info.key == "alice/"
    assert info.id.startswith(f"{registry.host}/gpusnap/alice@sha256:")
    assert info.extra["digest"] == info.id.split("@")[1] and info.extra["node"] == NODE
    assert info.image_bytes > 1 << 20
    # the container keeps running and nothing was deleted: the Hub stops it afterwards
    assert work.alive() and cluster.kube.deleted == []
    assert cluster.kube.checkpointed == ["jhub/jupyter-alice/notebook"]
    # the node's archive is gone once the image is verified
    assert list(cluster.kube.checkpoints.iterdir()) == []
    # the manifest carries the runtimes' and our annotations
    r = await AsyncHTTPClient().fetch(
        f"http://{registry.host}/v2/gpusnap/alice/manifests/{info.extra['digest']}",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
    )
    ann = json.loads(r.body)["annotations"]
    assert ann["io.kubernetes.cri-o.annotations.checkpoint.name"] == "notebook"
    assert ann["org.criu.checkpoint.container.name"] == "notebook"
    assert ann["org.jupyterhub.gpusnap.server"] == "alice/"
    assert ann["org.jupyterhub.gpusnap.gpu-bytes"] == "0"
    assert ann["org.jupyterhub.gpusnap.gpu-count"] == "0"  # no GPU state: restores anywhere
    assert "org.jupyterhub.gpusnap.gpu-model" not in ann

    assert (await backend.latest("alice", "")).id == info.id
    assert await backend.latest("alice", "other") is None
    assert [i.id for i in await backend.list("alice")] == [info.id]
    assert await backend.list("bob") == []
    (cm,) = cluster.kube.configmaps.values()
    assert cm["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "jupyterhub-gpusnap"

    # the Hub deletes the pod; the spawner's placeholder pod lands on the node; the agent restores
    secret = work.lines()[0][0]
    work.stop()
    cluster.kube.pods.pop(("jhub", "jupyter-alice"))
    placeholder = work.placeholder()
    cluster.add_user_pod("alice", placeholder_for=info.id, runtime=placeholder)
    try:
        pid = (await backend.restore(info, into=RestoreTarget("jhub", "jupyter-alice"))).pid
        assert pid in placeholder.cgroup_pids()
        assert os.readlink(f"/proc/{pid}/ns/net") == os.readlink(f"/proc/{placeholder.pid}/ns/net")
        seen = len(work.lines())
        after = (await work.wait_lines(seen + 1))[seen:]
        assert after[0][0] == secret and after[0][1] > 1
    finally:
        work.close()
        for r in cluster.agent._restored:
            r.criu.wait(timeout=30)

    await backend.delete(info.id)
    assert cluster.kube.configmaps == {} and await backend.latest("alice", "") is None
    r = await AsyncHTTPClient().fetch(
        f"http://{registry.host}/v2/gpusnap/alice/manifests/{info.extra['digest']}",
        raise_error=False,
    )
    assert r.code == 404


@pytest.mark.criu
async def test_checkpoint_to_pvc_through_the_apiserver_proxy(tmp_path):
    cluster = Cluster(tmp_path)
    await cluster.start(
        KubeletClient__kubelet_route="apiserver-proxy",
        AgentApp__pvc_paths=[str(tmp_path / "snapshots")],
    )
    work = Workload(tmp_path).start()
    try:
        await work.wait_lines(2)
        cluster.add_user_pod("alice", work)
        snapshots = tmp_path / "snapshots"
        snapshots.mkdir()
        # an archive a kubelet finished after an earlier, timed-out call; and another pod's
        stale = (
            cluster.kube.checkpoints
            / "checkpoint-jupyter-alice_jhub-notebook-2026-11-01T10:00:00Z.tar"
        )
        stale.write_bytes(b"old")
        bobs = (
            cluster.kube.checkpoints
            / "checkpoint-jupyter-bob_jhub-notebook-2026-11-01T10:00:00Z.tar"
        )
        bobs.write_bytes(b"bob")
        backend = KubernetesBackend(
            config=cluster.hub_config(
                KubernetesBackend__target="pvc", KubernetesBackend__pvc_path=str(snapshots)
            )
        )
        info = await backend.checkpoint(alice())
        archive = Path(info.id)
        assert archive.parent == snapshots and archive.suffix == ".tar"
        record = json.loads(archive.with_suffix(".json").read_text())
        assert record["digest"] == info.extra["digest"] and record["server"] == "alice/"
        from tests.helpers.fake_kube import tar_names

        names = tar_names(archive)
        for entry in (
            "config.dump",
            "spec.dump",
            "checkpoint/inventory.img",
            "rootfs-diff.tar",
            "dump.log",
            "stats-dump",
        ):
            assert entry in names
        assert any(
            path.startswith(
                f"/api/v1/nodes/{NODE}/proxy/checkpoint/jhub/jupyter-alice/notebook?timeout="
            )
            for _, path, _ in cluster.kube.requests
        )
        assert work.alive() and cluster.kube.deleted == []
        assert list(cluster.kube.checkpoints.iterdir()) == [bobs]
    finally:
        work.stop()
        await cluster.stop()


FAILURES = {
    "gate-off": ({"kubelet_mode": "gate-off"}, {}, "enable the ContainerCheckpoint feature gate"),
    "runtime-500": ({"kubelet_mode": "error"}, {}, "criu check"),
    "hang": ({"kubelet_mode": "hang"}, {"KubernetesBackend__timeout": 1}, "no answer within 1.5s"),
    "rbac-direct": ({"forbidden": {"nodes/checkpoint"}}, {}, "'create' on 'nodes/checkpoint'"),
    "registry-readonly": ({}, {"registry": "readonly"}, "does not accept pushes"),
    "registry-auth": ({}, {"registry": "basic"}, "give the agent push credentials"),
}


@pytest.mark.criu
@pytest.mark.parametrize("case", list(FAILURES))
async def test_failed_checkpoint_leaves_the_pod_running_with_a_clear_error(cluster, tmp_path, case):
    kube_setup, backend_setup, message = FAILURES[case]
    backend_setup = dict(backend_setup)
    registry = await Registry(tmp_path / "registry", backend_setup.pop("registry", "open")).start()
    work = Workload(tmp_path).start()
    try:
        await work.wait_lines(2)
        cluster.add_user_pod("alice", work)
        for key, value in kube_setup.items():
            setattr(cluster.kube, key, value)
        backend = KubernetesBackend(
            config=cluster.hub_config(
                KubernetesBackend__repository_template=f"{registry.host}/gpusnap/{{username}}",
                **backend_setup,
            )
        )
        with pytest.raises(CheckpointError) as err:
            await backend.checkpoint(alice())
        assert "alice/: checkpoint failed, the server keeps running" in str(err.value)
        assert message in str(err.value)
        assert work.alive() and cluster.kube.deleted == []
        assert cluster.kube.configmaps == {}
        # the archive stays on the node when the push failed on the registry's side (5xx),
        # until a checkpoint of the container ships; otherwise none is left
        archives = list(cluster.kube.checkpoints.iterdir())
        assert len(archives) == (1 if case.startswith("registry") else 0), archives
        assert cluster.agent.kept_archives.kept() == archives
        assert await backend.latest("alice", "") is None
        lines = len(work.lines())
        await work.wait_lines(lines + 1)  # still running, still writing
    finally:
        work.stop()
        registry.stop()


@pytest.mark.criu
async def test_rbac_denied_node_proxy_names_the_permission(tmp_path):
    cluster = Cluster(tmp_path)
    await cluster.start(
        KubeletClient__kubelet_route="apiserver-proxy", AgentApp__pvc_paths=[str(tmp_path)]
    )
    work = Workload(tmp_path).start()
    try:
        cluster.add_user_pod("alice", work)
        cluster.kube.forbid("nodes/proxy")
        backend = KubernetesBackend(
            config=cluster.hub_config(
                KubernetesBackend__target="pvc", KubernetesBackend__pvc_path=str(tmp_path)
            )
        )
        with pytest.raises(CheckpointError) as err:
            await backend.checkpoint(alice())
        text = str(err.value)
        assert (
            'cannot create resource "nodes/proxy"' in text and "'create' on 'nodes/proxy'" in text
        )
        assert work.alive() and cluster.kube.deleted == [] and cluster.kube.checkpointed == []
    finally:
        work.stop()
        await cluster.stop()


async def test_backend_refuses_when_no_agent_runs_on_the_node(cluster):
    cluster.kube.pods.pop(("gpusnap", "gpusnap-agent-x7k2p"))
    cluster.add_user_pod("alice")
    backend = KubernetesBackend(config=cluster.hub_config())
    with pytest.raises(CheckpointRefused, match="no gpusnap agent pod runs on node gpu-node-1"):
        await backend.check(alice())
    with pytest.raises(CheckpointRefused, match="deploy the agent DaemonSet"):
        await backend.checkpoint(alice())
    with pytest.raises(CheckpointRefused, match='pods \\\\?"jupyter-carol\\\\?" not found'):
        await backend.checkpoint(Server(user="carol"))
    assert cluster.kube.checkpointed == []


# -- GPU checkpoints: recorded when taken, compared with the node's GPUs at restore ---------

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
DRIVER = "580.159.04"


class NodeNvml(FakeNvmlLib):
    """NVML of a node with the GPUs ``devices`` under NVIDIA driver ``driver``."""

    def __init__(self, devices, driver=DRIVER):
        super().__init__(devices)
        self.driver = driver

    def nvmlSystemGetDriverVersion(self):
        return self.driver


def give_node_gpus(
    cluster: Cluster,
    libcuda: FakeLibcuda | None,
    models: list[str],
    driver: str = DRIVER,
    held: dict[int, dict[int, int]] | None = None,
) -> None:
    """Put the agent on a node with GPUs ``models`` (wire-level NVML and libcuda fakes);
    ``held``: GPU memory per device and pid. ``libcuda`` None: no driver at all (this
    machine's real NVML and libcuda, both absent)."""
    agent = cluster.agent
    if libcuda is None:
        agent.nvml = Nvml()
        agent.cuda = CudaCheckpoint(parent=agent, nvml=agent.nvml)
        return
    devices = [
        {"name": m, "procs": dict((held or {}).get(i, {})), "samples": [], "util": 0}
        for i, m in enumerate(models)
    ]
    agent.nvml = Nvml(NodeNvml(devices, driver))
    agent.cuda = CudaCheckpoint(parent=agent, driver=libcuda, nvml=agent.nvml)


def gpu_user_pod(
    cluster: Cluster, work: Workload, models: list[str], gpu: int, nbytes: int
) -> FakeLibcuda:
    """alice's pod running ``work``, whose process holds ``nbytes`` on GPU ``gpu`` of a node
    with GPUs ``models``; the node's (fake) driver, which knows that process."""
    pod = cluster.add_user_pod("alice", work)
    cluster.map_process(pod, work.pid)
    libcuda = FakeLibcuda([work.pid])
    give_node_gpus(cluster, libcuda, models, held={gpu: {work.pid: nbytes}})
    return libcuda


class RestoringLibcuda(FakeLibcuda):
    """The fake driver of a node where CRIU brings a GPU process back into ``placeholder``:
    a process it has not seen, running in the placeholder's cgroup, is the checkpointed
    one (its CUDA state, checkpointed, came back with the memory CRIU restored)."""

    placeholder = None

    def _adopt(self, pid):
        if pid not in self.states and self.placeholder is not None:
            if pid in self.placeholder.cgroup_pids():
                self.states[pid] = CHECKPOINTED

    def cuCheckpointProcessGetState(self, pid, ref):
        self._adopt(pid)
        return super().cuCheckpointProcessGetState(pid, ref)

    def _step(self, name, pid, want, new, fail_code=None):
        self._adopt(pid)
        return super()._step(name, pid, want, new, fail_code)


REFUSALS = {
    "other-model": (
        [A100, A100],
        DRIVER,
        [f"taken on {H100}", f"this node has {A100}"],
        [f"restore it on a {H100} node", "same GPU model"],
    ),
    "too-few-gpus": ([H100], DRIVER, ["used GPU 1", "1 GPU(s)"], ["at least 2"]),
    "other-driver": (
        [H100, H100],
        "590.44.01",
        [f"NVIDIA driver {DRIVER}", "runs 590.44.01"],
        [f"go back to {DRIVER}", "before upgrading the driver"],
    ),
    "no-gpu": (None, "", ["no usable GPU", "NVMLError"], ["restore it on a node with that GPU"]),
}


@pytest.mark.criu
async def test_gpu_checkpoint_records_its_gpus_and_restores_only_where_they_match(tmp_path):
    """The agent records the GPU model, devices and driver of a GPU checkpoint in the
    shipped record and its reply; a restore on a node whose GPUs or driver differ is
    refused (409, naming the difference and the fix) before anything is fetched or CRIU
    runs; on a matching node the tree comes back and its GPU memory is resumed."""
    cluster = Cluster(tmp_path)
    restore_dir = tmp_path / "restore"
    await cluster.start(
        AgentApp__restore_dir=str(restore_dir),
        AgentApp__pvc_paths=[str(tmp_path / "pvc")],
        PodMapper__proc_root="/proc",
        PodMapper__cgroup_root=str(cgroup2_mount()),
    )
    work = Workload(tmp_path).start()
    try:
        before = await work.wait_lines(3)
        # a two-GPU H100 node; the server's process holds 2 GiB on GPU 1
        cluster.add_user_pod("alice", work)
        libcuda = RestoringLibcuda([work.pid])
        give_node_gpus(cluster, libcuda, [H100, H100], held={1: {work.pid: 2 << 30}})
        pvc = tmp_path / "pvc"
        pvc.mkdir()

        code, body = await cluster.agent_call(
            "POST",
            "/v1/checkpoint",
            {
                "namespace": "jhub",
                "pod": "jupyter-alice",
                "container": "notebook",
                "target": {"kind": "pvc", "path": str(pvc)},
            },
        )
        assert code == 200, body
        assert body["gpu_bytes"] == 2 << 30
        assert body["gpu"] == {"model": H100, "count": 1, "devices": [1], "driver_version": DRIVER}
        assert libcuda.states[work.pid] == CHECKPOINTED  # GPU memory went to host memory
        record = json.loads(Path(body["id"]).with_suffix(".json").read_text())
        assert record["annotations"] == {
            "org.jupyterhub.gpusnap.gpu-model": H100,
            "org.jupyterhub.gpusnap.gpu-count": "1",
            "org.jupyterhub.gpusnap.gpu-devices": "1",
            "org.jupyterhub.gpusnap.driver-version": DRIVER,
        }
        work.stop()  # the Hub deletes the pod
        cluster.kube.pods.pop(("jhub", "jupyter-alice"))
        placeholder = work.placeholder()
        cluster.add_user_pod("alice", placeholder_for=body["id"], runtime=placeholder)
        libcuda.placeholder = placeholder
        restore = {
            "namespace": "jhub",
            "pod": "jupyter-alice",
            "container": "notebook",
            "image": body["id"],
        }

        calls = list(libcuda.calls)
        for case, (models, driver, words, fixes) in REFUSALS.items():
            give_node_gpus(cluster, libcuda if models else None, models or [], driver)
            code, refused = await cluster.agent_call("POST", "/v1/restore", restore)
            assert code == 409, (case, refused)
            assert refused["error"].startswith(
                f"checkpoint {body['id']} cannot be restored on node {NODE}: "
            ), case
            for w in words:
                assert w in refused["error"], (case, w, refused)
            for f in fixes:
                assert f in refused["fix"], (case, f, refused)
            # refused before fetching or CRIU: no scratch folder, no driver call
            assert not restore_dir.exists() or list(restore_dir.iterdir()) == [], case
            assert libcuda.calls == calls, case
        assert placeholder.cgroup_pids() == [placeholder.pid]  # nothing was restored

        give_node_gpus(cluster, libcuda, [H100, H100])
        code, done = await cluster.agent_call("POST", "/v1/restore", restore)
        assert code == 200, done
        restored = done["pid"]
        assert restored in placeholder.cgroup_pids() and restored != placeholder.pid
        # the restored process's GPU memory went back to the GPU and it runs again
        assert libcuda.calls[len(calls) :] == [("restore", restored), ("unlock", restored)]
        assert libcuda.states[restored] == RUNNING
        seen = len(work.lines())
        after = (await work.wait_lines(seen + 2))[seen:]
        assert all(secret == before[0][0] for secret, _ in after)
    finally:
        work.close()  # the placeholder pod too: the restored tree with it
        for r in cluster.agent._restored:  # criu exits once its restored tree is gone
            r.criu.wait(timeout=30)
        await cluster.stop()


# -- the agent signal --------------------------------------------------------------------


async def test_agent_signal_reads_cpu_of_the_servers_pod(cluster):
    pod = cluster.add_user_pod("alice", name="gpu")
    uid = pod["metadata"]["uid"]
    cluster.map_process(pod, 5151, usage_usec=1_000_000)
    ticks = itertools.count(50.0, 2.0)
    cluster.agent.cpu.clock = lambda: next(ticks)
    source = AgentSignal(config=cluster.hub_config())

    server = Server(user="alice", name="gpu")  # no state: the pod name comes from the template
    sample = await source.sample(server, now=1.0)
    assert sample.errors == {} and sample.cpu_percent == 0.0 and sample.gpu_percent is None
    cluster.tree.set_cpu(uid, 2_000_000)
    sample = await source.sample(server, now=2.0)
    assert sample.cpu_percent == pytest.approx(50.0) and sample.time == 2.0
    node_reads = [
        r
        for r in cluster.kube.requests
        if r[1] == "/api/v1/namespaces/jhub/pods/jupyter-alice--gpu"
    ]
    assert len(node_reads) == 1  # placement cached

    sample = await source.sample(Server(user="zoe"), now=3.0)
    assert sample.cpu_percent is None and "jupyter-zoe" in sample.errors["agent"]


async def test_console_entry_point_serves_the_api(cluster, tmp_path):
    """``jupyterhub-gpusnap-agent --config=FILE --port=N``: a real process; the command line wins."""
    port = free_port()
    config = tmp_path / "agent_config.py"
    config.write_text(
        "c.AgentApp.port = 1\n"
        f"c.AgentApp.ip = '127.0.0.1'\n"
        f"c.AgentApp.api_token_file = {str(cluster.secret_file)!r}\n"
        f"c.KubeAPI.api_url = {cluster.kube.api_url!r}\n"
        f"c.KubeAPI.token_file = {str(cluster.agent_token_file)!r}\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "from jupyterhub_gpusnap.agent.app import main; main()",
        f"--config={config}",
        f"--port={port}",
        f"--node={NODE}",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        for _ in range(200):
            try:
                r = await AsyncHTTPClient().fetch(
                    f"http://127.0.0.1:{port}/healthz",
                    headers={"Authorization": f"Bearer {AGENT_SECRET}"},
                )
                break
            except OSError:
                assert proc.returncode is None, (await proc.stderr.read()).decode()
                await asyncio.sleep(0.05)
        assert json.loads(r.body) == {"ok": True, "node": NODE, "criu": "4.2.1", "driver": None}
    finally:
        proc.terminate()
        await proc.wait()


# -- park through the agent (the service on Kubernetes) -----------------------------------


async def test_backend_parks_and_unparks_a_pods_gpu_memory_through_the_agent(tmp_path):
    """The service parks a server on Kubernetes by asking the agent on its node: the
    agent locks and checkpoints only the processes holding GPU memory (wire-level driver
    and NVML fakes), refuses with 'busy' while a cell runs, and unparks on request."""
    cluster = Cluster(tmp_path)
    await cluster.start()
    work = Workload(tmp_path).start()
    try:
        await work.wait_lines(1)
        libcuda = gpu_user_pod(cluster, work, [H100], gpu=0, nbytes=3 << 30)
        backend = KubernetesBackend(config=cluster.hub_config())

        libcuda.busy.add(work.pid)  # a cell is running on the GPU
        with pytest.raises(CheckpointRefused, match="park refused") as refused:
            await backend.park(alice())
        assert refused.value.retry and libcuda.states[work.pid] == RUNNING
        libcuda.busy.discard(work.pid)

        parked = await backend.park(alice())
        assert parked.pids == [work.pid] and parked.bytes_moved == 3 << 30
        assert libcuda.states[work.pid] == CHECKPOINTED
        again = await backend.park(alice())  # idempotent
        assert libcuda.states[work.pid] == CHECKPOINTED and again.pids == [work.pid]

        back = await backend.park(alice(), unpark=True)
        assert back.pids == [work.pid] and libcuda.states[work.pid] == RUNNING
        assert work.alive()

        # the service's watcher parks through the backend (it has no GPU of its own here)
        store = Store("sqlite://")
        watcher = Watcher(
            hub=None, store=store, policy=Policy([], Rule()), sources=[], backend=backend
        )
        status = ServerStatus(key="alice/", user="alice", state=State.idle)
        result = await watcher.room.park(alice(), status, reason="test")
        assert result.bytes_moved == 3 << 30 and libcuda.states[work.pid] == CHECKPOINTED
        (event,) = [e for e in store.events("alice/") if e["kind"] == "park"]
        assert event["detail"]["bytes"] == 3 << 30 and event["detail"]["pids"] == [work.pid]
        await watcher.room.park(alice(), status, unpark=True)
        assert libcuda.states[work.pid] == RUNNING
    finally:
        work.stop()
        await cluster.stop()


async def test_agent_restarted_after_dying_mid_checkpoint_gives_the_gpu_memory_back(tmp_path):
    """The agent froze a pod's GPU memory for a checkpoint and died before it ended (during
    the upload, say): the server runs on, so a restarted agent resumes that GPU memory and
    deletes the half-shipped archive before it serves anything."""
    cluster = Cluster(tmp_path)
    await cluster.start(AgentApp__restore_dir=str(tmp_path / "restore"))
    work = Workload(tmp_path).start()
    try:
        await work.wait_lines(1)
        libcuda = gpu_user_pod(cluster, work, [H100], gpu=0, nbytes=2 << 30)
        agent = cluster.agent
        # the state a crash mid-upload leaves: GPU memory frozen, its record, the archive
        await agent.cuda.suspend([work.pid])
        assert libcuda.states[work.pid] == CHECKPOINTED
        agent.backend.mark_in_progress("jhub", "jupyter-alice", "notebook", [work.pid])
        archive = (
            cluster.kube.checkpoints
            / "checkpoint-jupyter-alice_jhub-notebook-2026-11-23T01:00:00Z.tar"
        )
        archive.write_bytes(b"half an archive")

        await agent.stop_http()
        await agent.start_http()  # the agent's pod restarted

        assert libcuda.states[work.pid] == RUNNING and work.alive()
        assert not archive.exists()
        assert not list(agent.in_progress_dir.glob("*"))
        code, _ = await cluster.agent_call("GET", "/healthz")
        assert code == 200
    finally:
        work.stop()
        await cluster.stop()


async def test_a_checkpoint_that_cannot_record_its_freeze_gives_the_gpu_memory_back(tmp_path):
    """The agent froze a pod's GPU memory but could not write the record a restarted agent
    would undo it from (where its folder should be is a file): the checkpoint fails and the
    GPU memory is resumed at once, not left frozen under a server that runs on."""
    cluster = Cluster(tmp_path)
    restore_dir = tmp_path / "restore"
    await cluster.start(AgentApp__restore_dir=str(restore_dir))
    work = Workload(tmp_path).start()
    try:
        await work.wait_lines(1)
        libcuda = gpu_user_pod(cluster, work, [H100], gpu=0, nbytes=2 << 30)
        restore_dir.mkdir(parents=True, exist_ok=True)
        cluster.agent.in_progress_dir.write_text("not a folder")

        code, body = await cluster.agent_call(
            "POST",
            "/v1/checkpoint",
            {
                "namespace": "jhub",
                "pod": "jupyter-alice",
                "container": "notebook",
                "target": {"kind": "registry", "repository": "registry.invalid/gpusnap/alice"},
            },
        )
        assert code == 500 and "FileExistsError" in body["error"], body
        assert libcuda.states[work.pid] == RUNNING and work.alive()
        assert not list(cluster.kube.checkpoints.glob("*.tar"))  # no dump was taken
    finally:
        work.stop()
        await cluster.stop()
