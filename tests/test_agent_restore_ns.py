"""The agent restores a checkpoint into the placeholder pod's container, for real.

A real runc container (fake_kube.Workload, in its own pod sandbox) stands for the notebook
container; the runtime checkpoints it (``runc checkpoint``, CRI-O's archive) through the
fake kubelet. A second real container, ``sleep infinity`` in another pod sandbox with the
same volume and placed in a cgroup named like a pod container's, is the placeholder.
``POST /v1/restore`` must find the placeholder through the agent's host-PID → pod mapping
(real /proc, real cgroups) and restore the process into the placeholder's namespaces and
cgroup, memory intact.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from traitlets import TraitError

from jupyterhub_gpusnap.agent.app import AgentApp
from jupyterhub_gpusnap.agent.node_backend import NodeBackend
from jupyterhub_gpusnap.agent.ship import PvcStore, Shipper
from jupyterhub_gpusnap.checkpoint import criu as criu_tools
from jupyterhub_gpusnap.checkpoint.base import (
    CheckpointError,
    CheckpointInfo,
    Restored,
    RestoreTarget,
)
from jupyterhub_gpusnap.kubespawner import PLACEHOLDER_ANNOTATION
from tests.helpers.fake_kube import Cluster, Workload, cgroup2_mount

pytestmark = [pytest.mark.k8s, pytest.mark.criu]

NAMESPACES = ("net", "ipc", "uts")


def ns_of(pid: int | str) -> dict[str, str]:
    return {ns: os.readlink(f"/proc/{pid}/ns/{ns}") for ns in NAMESPACES}


def cgroup_of(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise AssertionError(f"pid {pid} has no cgroup v2 line")


async def start_cluster(tmp_path: Path) -> Cluster:
    """A cluster whose agent reads this machine's real /proc and cgroup v2 tree."""
    return await Cluster(tmp_path).start(
        PodMapper__proc_root="/proc",
        PodMapper__cgroup_root=str(cgroup2_mount()),
        AgentApp__restore_dir=str(tmp_path / "restore"),
    )


def placeholder_pod(cluster: Cluster, image: str, runtime=None) -> dict:
    """The placeholder pod SnapKubeSpawner creates in place of the deleted user pod."""
    pod = cluster.add_user_pod("alice", placeholder_for=image, runtime=runtime)
    assert pod["metadata"]["annotations"][PLACEHOLDER_ANNOTATION] == image
    return pod


async def test_restore_joins_the_placeholders_namespaces_and_cgroup(tmp_path):
    cluster = await start_cluster(tmp_path)
    work = Workload(tmp_path).start()
    try:
        dumped_ns = ns_of(work.pid)
        assert dumped_ns != ns_of("self")  # a container of its own
        before = await work.wait_lines(3)
        secret = before[0][0]
        cluster.add_user_pod("alice", work)
        path = await cluster.kube.kubelet_checkpoint("jhub", "jupyter-alice", "notebook")
        archive = cluster.kube.checkpoints / os.path.basename(path)
        pvc = tmp_path / "pvc"
        pvc.mkdir()
        shipped = await PvcStore(Shipper(), pvc).ship(
            archive, server="alice/", container="", gpu_bytes=0, created=time.time()
        )

        # the server's pod is deleted; the placeholder takes its place (another pod)
        work.stop()
        cluster.kube.pods.pop(("jhub", "jupyter-alice"))
        placeholder = work.placeholder()
        placeholder_pod(cluster, shipped.id, placeholder)
        assert ns_of(placeholder.pid) not in (ns_of("self"), dumped_ns)

        code, body = await cluster.restore_into(shipped.id)
        assert code == 200, body
        restored = body["pid"]
        assert body["placeholder_pid"] == placeholder.pid
        # in the placeholder's namespaces, not the agent's nor the dumped container's
        assert ns_of(restored) == ns_of(placeholder.pid) == body["namespaces"]
        assert ns_of(restored) != ns_of("self")
        # in the placeholder container's cgroup, so the pod's limits and deletion apply
        assert cgroup_of(restored) == cgroup_of(placeholder.pid) == placeholder.cgroup_path
        assert body["cgroup"] == placeholder.cgroup_path
        assert restored in placeholder.cgroup_pids()
        # criu itself was started there (the restored tree is born in the pod's cgroup,
        # not moved in afterwards): the agent never moves criu
        (criu,) = cluster.agent._restored
        assert cgroup_of(criu.criu.pid) == placeholder.cgroup_path
        # the process state survived: the same secret, the counter goes on from the dump
        at_restore = len(work.lines())
        after = await work.wait_lines(at_restore + 2)
        new = after[at_restore:]
        assert all(s == secret for s, _ in new)
        assert new[0][1] > before[-1][1]
        assert not (tmp_path / "restore").exists() or not list((tmp_path / "restore").iterdir())
    finally:
        work.close()  # the placeholder pod is deleted: the restored tree with it
        for r in cluster.agent._restored:  # criu exits once its restored tree is gone
            r.criu.wait(timeout=30)
        await cluster.stop()


async def test_restore_waits_for_a_running_placeholder_and_fetches_nothing(tmp_path):
    cluster = await start_cluster(tmp_path)
    try:
        # the placeholder pod exists but none of its processes runs on this node
        placeholder_pod(cluster, "/nowhere/alice.tar")
        code, body = await cluster.restore_into("/nowhere/alice.tar")
        assert code == 409, body
        assert "no process of container notebook (pod jhub/jupyter-alice)" in body["error"]
        assert "hostPID" in body["fix"]
        # a container that does not exist in the pod is named as such
        code, body = await cluster.restore_into("/nowhere/alice.tar", container="lab")
        assert code == 409 and "container lab of placeholder pod" in body["error"]
        assert "placeholder_command" in body["fix"]
        # a pod that is not the placeholder of this image (a user's running server) is
        # never restored into
        code, body = await cluster.restore_into("/nowhere/bob.tar")
        assert code == 409 and "is not a placeholder for /nowhere/bob.tar" in body["error"]
        cluster.add_user_pod("carol")
        code, body = await cluster.agent_call(
            "POST",
            "/v1/restore",
            {"namespace": "jhub", "pod": "jupyter-carol", "image": "/nowhere/alice.tar"},
        )
        assert code == 409 and f"{PLACEHOLDER_ANNOTATION}: (none)" in body["error"]
    finally:
        await cluster.stop()


async def test_a_containers_checkpoint_is_not_restored_outside_a_container(tmp_path):
    """restore_into = "agent" (one machine, no pods) cannot give a container's checkpoint
    its root filesystem and volumes: refused, naming the setting, and the image kept."""
    cluster = await Cluster(tmp_path).start(AgentApp__restore_into="agent")
    work = Workload(tmp_path).start()
    try:
        await work.wait_lines(2)
        cluster.add_user_pod("alice", work)
        path = await cluster.kube.kubelet_checkpoint("jhub", "jupyter-alice", "notebook")
        pvc = tmp_path / "pvc"
        pvc.mkdir()
        shipped = await PvcStore(Shipper(), pvc).ship(
            cluster.kube.checkpoints / os.path.basename(path),
            server="alice/",
            container="",
            gpu_bytes=0,
            created=time.time(),
        )
        work.stop()
        code, body = await cluster.restore_into(shipped.id)
        assert code == 409 and "it can only be restored into a container" in body["error"], body
        assert "AgentApp.restore_into = 'placeholder'" in body["fix"]
        assert Path(shipped.id).exists() and cluster.agent._restored == []
    finally:
        work.close()
        await cluster.stop()


async def test_criu_restore_refuses_a_cgroup_it_cannot_enter(tmp_path):
    missing = tmp_path / "no-such-cgroup"
    with pytest.raises(CheckpointError, match="no-such-cgroup/cgroup.procs is not writable"):
        await criu_tools.restore(tmp_path, tmp_path / "restore.pid", cgroup=missing)
    assert not list(tmp_path.glob("restore-*.log"))  # criu never started


class RecordingBackend(NodeBackend):
    """Records the restore the agent asks of its backend; answers as a restore into a
    placeholder does, without restoring anything."""

    def __init__(self, agent: AgentApp):
        super().__init__(agent)
        self.calls: list[tuple] = []

    async def restore(self, info, timeout=600.0, into=None) -> Restored:
        self.calls.append((info, timeout, into))
        detail = {"placeholder_pid": 17, "namespaces": {"net": "net:[1]"}, "cgroup": "/pod"}
        return Restored(pid=4242, node=self.agent.node_name, detail=detail)


async def test_post_restore_is_the_backends_restore_into_the_named_pod(tmp_path):
    """``POST /v1/restore`` only reads the request, calls ``NodeBackend.restore(info,
    timeout, into=RestoreTarget(...))`` and answers what it returned."""
    cluster = await Cluster(tmp_path).start(AgentApp__restore_timeout=77.0)
    try:
        agent = cluster.agent
        agent.backend = RecordingBackend(agent)
        code, body = await cluster.restore_into("/nowhere/alice.tar", container="lab")
        assert code == 200, body
        assert body == {
            "restored": True,
            "pid": 4242,
            "placeholder_pid": 17,
            "namespaces": {"net": "net:[1]"},
            "cgroup": "/pod",
        }
        ((info, timeout, into),) = agent.backend.calls
        assert info.id == "/nowhere/alice.tar" and info.status == "verified"
        assert timeout == 77.0
        assert into == RestoreTarget("jhub", "jupyter-alice", "lab")
        # the pod is claimed while its restore runs, and free again after it
        code, _ = await cluster.restore_into("/nowhere/alice.tar", container="lab")
        assert code == 200 and len(agent.backend.calls) == 2
    finally:
        await cluster.stop()


async def test_the_node_agent_keeps_no_list_of_checkpoints():
    backend = NodeBackend(AgentApp(node_name="gpu-1"))
    for call in (
        backend.latest("alice", ""),
        backend.list(),
        backend.get("x"),
        backend.delete("x"),
    ):
        with pytest.raises(
            CheckpointError, match="node agent on gpu-1 keeps no list of checkpoints"
        ):
            await call
    with pytest.raises(CheckpointError, match="restores into a pod"):
        await backend.restore(
            CheckpointInfo("/nowhere/alice.tar", "alice", "", 0.0, "verified"), into=None
        )


def test_placeholder_annotation_is_the_spawners():
    from jupyterhub_gpusnap.agent.placeholder import PLACEHOLDER_ANNOTATION as AGENTS

    assert AGENTS == PLACEHOLDER_ANNOTATION


def test_only_joinable_namespaces_are_accepted():
    assert AgentApp(restore_join_namespaces=["net", "uts"]).restore_join_namespaces == [
        "net",
        "uts",
    ]
    with pytest.raises(TraitError, match="restore_join_namespaces.*'pid'"):
        AgentApp(restore_join_namespaces=["net", "pid"])
