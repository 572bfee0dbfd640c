"""Make room on Kubernetes: free GPU memory per GPU of each node, read from the node agents.

The API server is the wire-level fake (tests/helpers/fake_kube.py); each GPU node runs a real
agent (its own loopback address, its own /proc and cgroup tree); NVML and libcuda are the
ctypes-level fakes of tests/helpers/fake_gpu.py, whose memory follows what the fake driver
checkpointed (SharedGpus there). The servers' processes are real.
"""

from __future__ import annotations

import logging
import time

import pytest

from jupyterhub_gpusnap.checkpoint.kubernetes import KubernetesBackend
from jupyterhub_gpusnap.gpu.cuda import CudaCheckpoint
from jupyterhub_gpusnap.gpu.nvml import Nvml
from jupyterhub_gpusnap.gpu.view import RoomRequestError
from jupyterhub_gpusnap.model import Server, State
from jupyterhub_gpusnap.policy import Policy, Rule, ServerStatus
from jupyterhub_gpusnap.store import Store
from jupyterhub_gpusnap.watcher import Watcher
from tests.helpers.fake_gpu import CHECKPOINTED, RUNNING, FakeLibcuda, SharedGpus, U
from tests.helpers.fake_kube import NODE, Cluster
from tests.helpers.gpusnap_service import GpuSnapService
from tests.helpers.metrics import metric

pytestmark = pytest.mark.k8s

NODE2 = "gpu-node-2"
log = logging.getLogger("test-k8s-make-room")


class NodeGpus(SharedGpus):
    """A node's GPUs as NVML shows them (80 U each; memory follows the node's driver)."""

    def nvmlSystemGetDriverVersion(self):
        return "580.159.04"


def give_gpus(agent, libcuda: FakeLibcuda, devices: list[dict]) -> None:
    """Put ``agent``'s node on the fake GPUs ``devices`` driven by ``libcuda``."""
    agent.nvml = Nvml(NodeGpus(libcuda, devices))
    agent.cuda = CudaCheckpoint(parent=agent, driver=libcuda, nvml=agent.nvml)


def gpu(procs: dict[int, int], other: int = 0, uuid: str = "") -> dict:
    dev = {
        "name": "NVIDIA H100 80GB HBM3",
        "procs": procs,
        "other": other,
        "samples": [],
        "util": 0,
    }
    if uuid:
        dev["uuid"] = uuid
    return dev


@pytest.fixture
def procs(sleepers):
    """Real processes standing in for the servers' kernels (the fake driver checks they live)."""
    return sleepers(5)


@pytest.fixture
async def two_nodes(tmp_path):
    """A cluster with GPU nodes gpu-node-1 (agent on 127.0.0.1) and gpu-node-2 (127.0.0.2)."""
    cluster = Cluster(tmp_path)
    await cluster.start()
    await cluster.add_gpu_node(NODE2, "127.0.0.2")
    yield cluster
    await cluster.stop()


def server_pod(cluster: Cluster, user: str, pid: int, node: str = NODE) -> Server:
    """``user``'s server pod on ``node`` with ``pid`` as its process; the Server the Hub lists."""
    pod = cluster.add_user_pod(user, node=node)
    cluster.map_process(pod, pid)
    return Server(user=user, state={"pod_name": f"jupyter-{user}", "namespace": "jhub"})


def watcher_over(
    cluster: Cluster, tmp_path, servers: list[tuple[Server, State, float, int]], **traits
):
    """A watcher with the Kubernetes backend over ``servers`` (server, state, idle seconds,
    GPU bytes its last sample saw), as the agent signal would have left them."""
    store = Store(f"sqlite:///{tmp_path}/gpusnap.sqlite")
    backend = KubernetesBackend(config=cluster.hub_config())
    watcher = Watcher(hub=None, store=store, policy=Policy([], Rule()), sources=[], backend=backend, log=log,
                      **traits)  # fmt: skip
    now = time.time()
    for server, state, idle, held in servers:
        watcher.servers[server.key] = server
        store.put(ServerStatus(key=server.key, user=server.user, state=state, state_since=now,
                               last_active=now - idle, started=now - 7200,
                               last_sample={"gpu_memory_bytes": held}))  # fmt: skip
    return watcher


# -- the agent's GET /v1/gpus ---------------------------------------------------------------


async def test_gpus_lists_each_gpu_with_the_bytes_each_pod_holds_on_it(tmp_path):
    cluster = Cluster(tmp_path)
    await cluster.start()
    try:
        # without NVML (this machine as it is): no GPUs, and why
        code, body = await cluster.agent_call("GET", "/v1/gpus")
        assert code == 200 and body["gpus"] == [] and body["node"] == NODE
        assert body["reason"]  # NVML's own error, e.g. NVMLError_LibraryNotFound

        alice = cluster.add_user_pod("alice")
        bob = cluster.add_user_pod("bob", name="big")
        cluster.map_process(alice, 4242)
        cluster.map_process(alice, 4243)  # a second kernel of alice's
        cluster.map_process(bob, 5151)
        cluster.add_user_pod("carol")  # a pod with no process holding GPU memory
        libcuda = FakeLibcuda([])
        # GPU 0: alice's two kernels and a process outside any pod; GPU 1: alice and bob
        devices = [
            gpu({4242: 10 * U, 4243: 5 * U, 999: 7 * U}, uuid="GPU-8f3c2a1e-5b7d-4c9e-a1f2-3d4e5f6a7b8c"),
            gpu({4243: 2 * U, 5151: 30 * U}),
        ]  # fmt: skip
        give_gpus(cluster.agent, libcuda, devices)

        code, body = await cluster.agent_call("GET", "/v1/gpus")
        assert code == 200, body
        assert body == {
            "node": NODE,
            "checkpoint_api": True,
            "gpus": [
                {"index": 0, "uuid": "GPU-8f3c2a1e-5b7d-4c9e-a1f2-3d4e5f6a7b8c", "total_bytes": 80 * U,
                 "free_bytes": 58 * U, "pods": {"jhub/jupyter-alice": 15 * U}},
                {"index": 1, "total_bytes": 80 * U, "free_bytes": 48 * U,
                 "pods": {"jhub/jupyter-alice": 2 * U, "jhub/jupyter-bob--big": 30 * U}},
            ],
        }  # fmt: skip

        # a node whose driver lacks the checkpoint API says so: its pods cannot be parked
        cluster.agent.cuda = CudaCheckpoint(parent=cluster.agent, nvml=cluster.agent.nvml)
        code, body = await cluster.agent_call("GET", "/v1/gpus")
        assert body["checkpoint_api"] is False and body["checkpoint_api_reason"]
        assert [g["free_bytes"] for g in body["gpus"]] == [58 * U, 48 * U]

        code, body = await cluster.agent_call("GET", "/v1/gpus", token="wrong")
        assert code == 401 and "api_token_file" in body["fix"]
        code, body = await cluster.agent_call("GET", "/v1/gpus", token="")
        assert code == 401
    finally:
        await cluster.stop()


# -- make room on one GPU of one node -------------------------------------------------------


async def test_make_room_on_a_gpu_of_a_node_parks_only_idle_servers_there(
    two_nodes, tmp_path, procs
):
    cluster = two_nodes
    alice_pid, bob_pid, carol_pid, dave_pid, erin_pid = procs
    alice = server_pod(cluster, "alice", alice_pid)  # node 1, GPU 0
    bob = server_pod(cluster, "bob", bob_pid)  # node 1, GPU 1 only
    dave = server_pod(cluster, "dave", dave_pid)  # node 1, GPU 0, working
    erin = server_pod(cluster, "erin", erin_pid)  # node 1, GPU 0
    carol = server_pod(cluster, "carol", carol_pid, node=NODE2)  # node 2, GPU 0
    node1 = FakeLibcuda([alice_pid, bob_pid, dave_pid, erin_pid])
    node2 = FakeLibcuda([carol_pid])
    give_gpus(cluster.agents[NODE], node1, [gpu({alice_pid: 30 * U, dave_pid: 10 * U, erin_pid: 10 * U}),
                                            gpu({bob_pid: 20 * U})])  # fmt: skip
    give_gpus(cluster.agents[NODE2], node2, [gpu({carol_pid: 40 * U}), gpu({})])
    watcher = watcher_over(cluster, tmp_path, [
        (alice, State.idle, 900, 30 * U),
        (bob, State.idle, 1800, 20 * U),  # idle longer, but on the other GPU
        (carol, State.warned, 3600, 40 * U),  # idle longest, but GPU 0 of the other node
        (dave, State.active, 0, 10 * U),
        (erin, State.idle, 300, 10 * U),
    ])  # fmt: skip

    result = await watcher.room.make_room(25 * U, gpu=0, node=NODE)

    assert result == {"requested_bytes": 25 * U, "freed_bytes": 30 * U, "parked": ["alice/"],
                      "enough": True, "gpu": 0, "node": NODE}  # fmt: skip
    # the agent on node 1 parked alice's process: the driver checkpointed it, nothing else
    assert node1.states == {
        alice_pid: CHECKPOINTED,
        bob_pid: RUNNING,
        dave_pid: RUNNING,
        erin_pid: RUNNING,
    }
    assert ("checkpoint", alice_pid) in node1.calls
    assert node2.states == {carol_pid: RUNNING} and node2.calls == []
    assert watcher.store.get("alice/").state == State.parked
    (park,) = [e for e in watcher.store.events("alice/") if e["kind"] == "park"]
    assert park["detail"]["trigger"] == "api" and park["detail"]["gpu"] == 0
    assert park["detail"]["node"] == NODE and park["detail"]["pids"] == [alice_pid]
    assert "on GPU 0 of node gpu-node-1" in park["detail"]["reason"]

    # more than the GPU's idle servers hold: erin too, and it says it was not enough
    result = await watcher.room.make_room(80 * U, gpu=0, node=NODE)
    assert (
        result["parked"] == ["erin/"] and result["freed_bytes"] == 10 * U and not result["enough"]
    )
    assert node1.states[dave_pid] == RUNNING and node1.states[bob_pid] == RUNNING
    assert node2.states == {carol_pid: RUNNING}

    # a node alone: any of its GPUs, counting the bytes on that node only
    result = await watcher.room.make_room(U, node=NODE2)
    assert result["parked"] == ["carol/"] and result["freed_bytes"] == 40 * U
    assert result["node"] == NODE2 and "gpu" not in result
    assert node2.states == {carol_pid: CHECKPOINTED}

    # GPU 1 exists on both nodes: the index alone names no GPU; nor does an unknown node
    with pytest.raises(RoomRequestError, match=f'2 nodes \\({NODE}, {NODE2}\\).*"node": "{NODE}"'):
        await watcher.room.make_room(U, gpu=1)
    with pytest.raises(
        RoomRequestError, match="no GPU of node 'gpu-node-9'.*gpu-node-1, gpu-node-2"
    ):
        await watcher.room.make_room(U, gpu=1, node="gpu-node-9")
    assert node1.states[bob_pid] == RUNNING  # nothing was parked by the refused requests


# -- min_free_gpu_memory on Kubernetes ------------------------------------------------------


async def test_min_free_gpu_memory_keeps_each_gpu_of_each_node_above_the_floor(
    two_nodes, tmp_path, procs, caplog
):
    cluster = two_nodes
    alice_pid, bob_pid, carol_pid, dave_pid, erin_pid = procs
    alice = server_pod(cluster, "alice", alice_pid)
    bob = server_pod(cluster, "bob", bob_pid)
    carol = server_pod(cluster, "carol", carol_pid, node=NODE2)
    dave = server_pod(cluster, "dave", dave_pid, node=NODE2)
    erin = server_pod(cluster, "erin", erin_pid)
    node1 = FakeLibcuda([alice_pid, bob_pid, erin_pid])
    node2 = FakeLibcuda([carol_pid, dave_pid])
    # node 1, GPU 0: 80 - (30 + 20 + 15) - 5 (no server's) = 10 U free; GPU 1: 80 free
    give_gpus(cluster.agents[NODE], node1, [gpu({alice_pid: 30 * U, bob_pid: 20 * U, erin_pid: 15 * U},
                                                other=5 * U), gpu({})])  # fmt: skip
    # node 2, GPU 0: 80 - 40 - 10 = 30 U free: above the floor though its servers are idle
    give_gpus(cluster.agents[NODE2], node2, [gpu({carol_pid: 40 * U, dave_pid: 10 * U})])
    watcher = watcher_over(cluster, tmp_path, [
        (alice, State.idle, 900, 30 * U),
        (bob, State.warned, 1200, 20 * U),  # idle longest on node 1's GPU 0
        (erin, State.idle, 60, 15 * U),  # not idle for min_free_gpu_memory_idle yet
        (carol, State.idle, 9000, 40 * U),
        (dave, State.idle, 9000, 10 * U),
    ], min_free_gpu_memory=25 * U, min_free_gpu_memory_idle=300)  # fmt: skip

    with caplog.at_level(logging.INFO, logger=log.name):
        (result,) = await watcher.room.keep_gpu_free()
    # 15 U short on node 1's GPU 0: bob (idle longest there) frees 20 U, enough
    assert result == {"requested_bytes": 15 * U, "freed_bytes": 20 * U, "parked": ["bob/"],
                      "enough": True, "gpu": 0, "node": NODE}  # fmt: skip
    assert node1.states == {alice_pid: RUNNING, bob_pid: CHECKPOINTED, erin_pid: RUNNING}
    assert node2.states == {carol_pid: RUNNING, dave_pid: RUNNING} and node2.calls == []
    status = watcher.store.get("bob/")
    assert status.state == State.parked and "min_free_gpu_memory" in status.reason
    (park,) = [e for e in watcher.store.events("bob/") if e["kind"] == "park"]
    assert park["detail"]["trigger"] == "min_free_gpu_memory" and park["detail"]["node"] == NODE
    assert metric("gpusnap_gpu_free_bytes", node=NODE, gpu="0") == 10 * U
    assert metric("gpusnap_gpu_free_bytes", node=NODE, gpu="1") == 80 * U
    assert metric("gpusnap_gpu_free_bytes", node=NODE2, gpu="0") == 30 * U

    # the next tick finds 30 U free on node 1's GPU 0: every GPU is above the floor, nothing happens
    calls = (list(node1.calls), list(node2.calls))
    assert await watcher.room.keep_gpu_free() == []
    assert (node1.calls, node2.calls) == calls
    assert metric("gpusnap_gpu_free_bytes", node=NODE, gpu="0") == 30 * U
    assert node1.states[alice_pid] == RUNNING and node2.states[carol_pid] == RUNNING

    # a higher floor: node 2's GPU 0 is short now and only its own idle servers are parked there
    watcher.min_free_gpu_memory = 35 * U
    results = await watcher.room.keep_gpu_free()
    by_node = {r["node"]: r for r in results}
    assert by_node[NODE2]["parked"] == ["carol/"] and by_node[NODE2]["enough"]
    assert node2.states == {carol_pid: CHECKPOINTED, dave_pid: RUNNING}
    assert by_node[NODE]["parked"] == ["alice/"]  # node 1's GPU 0: 30 U free, alice is next
    assert node1.states[erin_pid] == RUNNING  # too briefly idle, whatever the shortage

    # a third node whose agent has no NVML: the others are still kept, the log names it once
    await cluster.add_gpu_node("gpu-node-3", "127.0.0.3")
    with caplog.at_level(logging.INFO, logger=log.name):
        assert await watcher.room.keep_gpu_free() == []
        assert await watcher.room.keep_gpu_free() == []
    said = [r.getMessage() for r in caplog.records if "node gpu-node-3 not read" in r.getMessage()]
    assert len(said) == 1 and "NVML" in said[0]
    assert metric("gpusnap_gpu_free_bytes", node=NODE, gpu="0") == 60 * U

    # node 2's driver has no checkpoint API: short there, nothing is tried, and the log says why once
    agent2 = cluster.agents[NODE2]
    agent2.cuda = CudaCheckpoint(parent=agent2, nvml=agent2.nvml)
    watcher.min_free_gpu_memory = 75 * U
    calls = list(node2.calls)
    with caplog.at_level(logging.INFO, logger=log.name):
        results = await watcher.room.keep_gpu_free()
        assert [r["node"] for r in await watcher.room.keep_gpu_free()] == [NODE]
    # node 1's GPU 0 is short too, but its only server left is not idle long enough
    assert [(r["node"], r["parked"]) for r in results] == [(NODE, [])]
    assert node2.states[dave_pid] == RUNNING and node2.calls == calls  # the driver was not asked
    said = [r.getMessage() for r in caplog.records if "no CUDA checkpoint API" in r.getMessage()]
    assert len(said) == 1 and "GPU 0 of node gpu-node-2" in said[0]


# -- the admin API on a hub with two GPU nodes ----------------------------------------------


@pytest.mark.e2e
async def test_make_room_api_needs_the_node_with_a_gpu_on_a_hub_with_several_gpu_nodes(
    two_nodes, hub_factory, tmp_path
):
    cluster = two_nodes
    for agent in cluster.agents.values():
        give_gpus(agent, FakeLibcuda([]), [gpu({}), gpu({})])
    settings = f"""
c.GpuSnap.backend_class = "jupyterhub_gpusnap.checkpoint.kubernetes.KubernetesBackend"
c.AgentLocator.namespace = "jhub"
c.AgentConnection.agent_namespace = "gpusnap"
c.AgentConnection.agent_port = {cluster.agent.port}
c.AgentConnection.agent_token_file = {str(cluster.secret_file)!r}
c.KubeAPI.api_url = {cluster.kube.api_url!r}
c.KubeAPI.token_file = {str(cluster.hub_token_file)!r}
"""
    service = GpuSnapService(tmp_path / "gpusnap", settings)
    hub = await hub_factory(service.hub_config())
    await service.start(hub)
    try:
        code, body = await service.api("POST", "api/make-room", {"bytes": 1 << 30, "gpu": 0})
        assert code == 400, body
        assert f"GPUs on 2 nodes ({NODE}, {NODE2})" in body["message"]
        assert f'"node": "{NODE}"' in body["message"]  # the fix: name the node

        code, body = await service.api(
            "POST", "api/make-room", {"bytes": 1 << 30, "gpu": 0, "node": NODE2}
        )
        assert code == 200, body
        assert body == {"requested_bytes": 1 << 30, "freed_bytes": 0, "parked": [], "enough": False,
                        "gpu": 0, "node": NODE2}  # fmt: skip

        code, body = await service.api(
            "POST", "api/make-room", {"bytes": 1 << 30, "gpu": 0, "node": "gpu-x"}
        )
        assert code == 400 and "no GPU of node 'gpu-x'" in body["message"]
        code, body = await service.api("POST", "api/make-room", {"bytes": 1 << 30, "node": 3})
        assert code == 400 and "kubectl get nodes" in body["message"]
        # without 'gpu' the node is not needed: any idle server anywhere (none here)
        code, body = await service.api("POST", "api/make-room", {"bytes": 1 << 30})
        assert code == 200 and body["parked"] == []
        # one list of every agent pod (not one lookup per node or server)
        lists = [
            u
            for m, u, _ in cluster.kube.requests
            if u.startswith("/api/v1/namespaces/gpusnap/pods?")
        ]
        assert lists and all("fieldSelector" not in u for u in lists), lists
        assert "Traceback" not in service.log_text(), service.log_text()[-3000:]
    finally:
        await service.stop()
