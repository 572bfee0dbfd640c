"""The hub side's API-server calls through a gateway that fails (tests/helpers/fault_proxy.py in front
of the wire-level fake API server): what fails for a moment (no answer, 5xx) is tried again
with backoff, a 4xx never is; a create or delete whose answer was lost is not done twice."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
from traitlets import TraitError
from traitlets.config import Config

from jupyterhub_gpusnap.checkpoint.base import CheckpointInfo
from jupyterhub_gpusnap.checkpoint.kubernetes import KubernetesBackend
from jupyterhub_gpusnap.kube.errors import AgentError
from tests.helpers.fake_kube import HUB_USER, FakeKube
from tests.helpers.fault_proxy import Fault, FaultProxy

pytestmark = pytest.mark.k8s

CONFIGMAPS = r"^/api/v1/namespaces/jhub/configmaps"


@pytest.fixture
async def kube(tmp_path):
    k = await FakeKube(tmp_path / "kube").start()
    yield k
    await k.stop()


@pytest.fixture
async def proxy(kube):
    p = await FaultProxy(kube.api_url).start()
    yield p
    await p.stop()


def backend_through(proxy: FaultProxy, kube: FakeKube, tmp_path) -> KubernetesBackend:
    token = tmp_path / "hub-token"
    token.write_text(kube.add_token(HUB_USER))
    c = Config()
    c.KubeAPI.api_url = proxy.url
    c.KubeAPI.token_file = str(token)
    c.AgentLocator.namespace = "jhub"
    c.Backoff.retry_backoff = 0.01
    c.Backoff.retry_backoff_max = 0.05
    c.Backoff.retries = 3
    return KubernetesBackend(config=c)


def checkpoint() -> CheckpointInfo:
    return CheckpointInfo(
        id="registry.example.org/gpusnap/alice@sha256:" + "ab" * 32,
        user="alice",
        server_name="",
        created=time.time(),
        status="verified",
        image_bytes=1 << 30,
    )


async def test_checkpoint_records_survive_a_failing_gateway(kube, proxy, tmp_path):
    backend = backend_through(proxy, kube, tmp_path)
    info = checkpoint()
    proxy.faults = [
        # the record is created, the answer lost: the second try's 409 means done
        Fault("POST", CONFIGMAPS + "$", when="after", status=503),
        Fault("GET", CONFIGMAPS, status=502),
        Fault("DELETE", CONFIGMAPS + "/", when="after", status=504),
    ]

    await backend._record(info)
    assert len(kube.configmaps) == 1  # recorded once
    assert [code for m, p, _, code in proxy.forwarded if m == "POST"] == [201, 409]

    assert (await backend.latest("alice", "")).id == info.id
    assert proxy.count("GET", CONFIGMAPS) == 2

    await backend.delete(info.id)
    assert kube.configmaps == {}
    assert [code for m, p, _, code in proxy.forwarded if m == "DELETE"] == [200, 404]
    assert [f.hits for f in proxy.faults] == [1, 1, 1]


async def test_api_server_errors_that_mean_no_are_not_tried_again(kube, proxy, tmp_path):
    backend = backend_through(proxy, kube, tmp_path)
    kube.forbid("configmaps")
    with pytest.raises(AgentError) as raised:
        await backend.latest("alice", "")
    assert raised.value.code == 403
    assert proxy.count("GET", CONFIGMAPS) == 1

    # an API server that keeps failing: bounded, the last error named
    kube.forbidden.clear()
    proxy.faults = [Fault("GET", CONFIGMAPS, times=0, status=503)]
    with pytest.raises(AgentError, match="503"):
        await backend.latest("alice", "")
    assert proxy.faults[0].hits == 4


async def test_the_agents_api_server_calls_survive_a_failing_gateway(kube, proxy, tmp_path):
    """The agent's KubeAPI (what it looks pods and nodes up with, and reviews tokens with):
    a 502 is tried again; a create or delete whose answer was lost counts as done on the
    next try's 409/404 rather than being done twice; a first 404 is an error; a periodic
    read (retry=False) tries once."""
    from jupyterhub_gpusnap.kube.api import KubeAPI

    token = tmp_path / "agent-token"
    token.write_text(kube.add_token("system:serviceaccount:gpusnap:agent"))
    c = Config()
    c.Backoff.retry_backoff = 0.01
    c.Backoff.retry_backoff_max = 0.05
    c.KubeAPI.api_url = proxy.url
    c.KubeAPI.token_file = str(token)
    api = KubeAPI(config=c)
    assert api.backoff.retries == 5 and api.backoff.retry_backoff == 0.01
    kube.add_node("gpu-node-1")
    pod = r"^/api/v1/namespaces/jhub/pods/jupyter-alice$"
    kube.add_pod("jhub", "jupyter-alice", "gpu-node-1")

    proxy.faults = [Fault("GET", pod, status=502)]
    assert (await api.get_pod("jhub", "jupyter-alice"))["metadata"]["name"] == "jupyter-alice"
    assert proxy.count("GET", pod) == 2 and proxy.faults[0].hits == 1

    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {}}
    proxy.faults = [
        Fault("POST", CONFIGMAPS + "$", when="after", status=502),
        Fault("DELETE", CONFIGMAPS + "/x$", when="after", status=503),
    ]
    assert await api.request("POST", "/api/v1/namespaces/jhub/configmaps", body=cm) == {}
    assert list(kube.configmaps) == [("jhub", "x")]
    await api.request("DELETE", "/api/v1/namespaces/jhub/configmaps/x")
    assert kube.configmaps == {}
    assert [
        (m, code)
        for m, p, _, code in proxy.forwarded
        if p.startswith("/api/v1/namespaces/jhub/configmaps")
    ] == [("POST", 201), ("POST", 409), ("DELETE", 200), ("DELETE", 404)]
    # a 409 or 404 on the first try is the API server's answer, not a lost one
    with pytest.raises(AgentError) as raised:
        await api.request("DELETE", "/api/v1/namespaces/jhub/configmaps/x")
    assert raised.value.code == 404
    await api.request("POST", "/api/v1/namespaces/jhub/configmaps", body=cm)
    with pytest.raises(AgentError) as raised:
        await api.request("POST", "/api/v1/namespaces/jhub/configmaps", body=cm)
    assert raised.value.code == 409

    # a periodic read: one try, the caller's next tick is the retry
    proxy.faults = [Fault("GET", r"^/api/v1/pods", status=502)]
    with pytest.raises(AgentError) as raised:
        await api.list_pods(field_selector="spec.nodeName=gpu-node-1", retry=False)
    assert raised.value.code == 502 and proxy.count("GET", r"^/api/v1/pods") == 1


@pytest.mark.criu
async def test_a_push_that_fails_every_time_leaves_the_server_running(tmp_path):
    """Service → real agent → kubelet (real runc container) → a registry whose gateway
    refuses every chunk: the checkpoint fails after a bounded number of tries, saying so,
    and the server's container runs on; nothing is recorded. The kubelet's archive stays
    on the node (one per container) until a later checkpoint of the container ships."""
    from jupyterhub_gpusnap.checkpoint.base import CheckpointError
    from jupyterhub_gpusnap.model import Server
    from tests.helpers import oci_runtime
    from tests.helpers.fake_kube import Cluster, Workload, cgroup2_mount
    from tests.helpers.registry import Registry

    registry = await Registry(tmp_path / "registry").start()
    gateway = await FaultProxy(f"http://{registry.host}").start()
    cluster = Cluster(tmp_path)
    api_gateway = await FaultProxy(cluster.kube.api_url).start()  # the agent's API server
    await cluster.start(
        KubeAPI__api_url=api_gateway.url,
        PodMapper__proc_root="/proc",
        PodMapper__cgroup_root=str(cgroup2_mount()),
        AgentApp__runtime_state_dirs=[str(oci_runtime.RUNC_ROOT)],
        Backoff__retry_backoff=0.01,
        Backoff__retry_backoff_max=0.05,
        Backoff__retries=2,
    )
    work = Workload(tmp_path / "work").start()
    try:
        await work.wait_lines(2, timeout=60)
        cluster.add_user_pod("alice", work)
        backend = KubernetesBackend(
            config=cluster.hub_config(
                KubernetesBackend__repository_template=f"{gateway.host}/gpusnap/{{username}}",
                KubernetesBackend__registry_scheme="http",
                KubernetesBackend__timeout=120,
            )
        )
        gateway.faults = [Fault("PATCH", r"/blobs/uploads/.", times=0)]

        with pytest.raises(CheckpointError) as raised:
            await backend.checkpoint(
                Server(
                    user="alice", name="", state={"pod_name": "jupyter-alice", "namespace": "jhub"}
                )
            )

        message = str(raised.value)
        assert "checkpoint failed, the server keeps running" in message
        assert "502" in message and "gave up after 3 tries in a row" in message
        assert gateway.faults[0].hits == 3  # bounded
        assert cluster.kube.checkpointed == ["jhub/jupyter-alice/notebook"]  # one kubelet dump
        assert cluster.kube.configmaps == {}  # nothing recorded
        seen = len(work.lines())
        await work.wait_lines(seen + 2)  # the container runs on
        assert work.alive() and cluster.kube.deleted == []
        # the archive stays on the node, marked as kept
        kept = list(cluster.kube.checkpoints.iterdir())
        assert len(kept) == 1 and cluster.agent.kept_archives.kept() == kept

        # the registry is back: the next checkpoint ships, and the kept archive goes with its
        # own; the agent's pod lookup meets a 502 on the way and is tried again
        gateway.faults = []
        api_gateway.faults = [Fault("GET", r"^/api/v1/namespaces/jhub/pods/jupyter-alice$")]
        info = await backend.checkpoint(
            Server(user="alice", name="", state={"pod_name": "jupyter-alice", "namespace": "jhub"})
        )
        assert info.status == "verified" and len(cluster.kube.configmaps) == 1
        assert cluster.kube.checkpointed == ["jhub/jupyter-alice/notebook"] * 2
        assert list(cluster.kube.checkpoints.iterdir()) == []
        assert cluster.agent.kept_archives.kept() == []
        assert api_gateway.faults[0].hits == 1
    finally:
        work.close()
        await cluster.stop()
        await api_gateway.stop()
        await gateway.stop()
        registry.stop()


async def test_kept_archives_older_than_the_limit_are_swept_at_start_and_while_running(tmp_path):
    """Archives kept after a failed push of a container never checkpointed again do not stay
    forever: the agent deletes those older than kept_archive_max_age when it starts and
    while it runs; archives it did not keep (an admin's) are never touched."""
    import os

    from jupyterhub_gpusnap.agent.kept import KeptArchives
    from tests.helpers.fake_kube import Cluster

    folder = tmp_path / "kube" / "checkpoints"
    folder.mkdir(parents=True)

    def archive(pod: str) -> Path:
        path = folder / f"checkpoint-{pod}_jhub-notebook-2026-11-01T10:00:00Z.tar"
        path.write_bytes(b"memory of " + pod.encode())
        return path

    old, fresh, admins = archive("jupyter-old"), archive("jupyter-fresh"), archive("jupyter-admin")
    marks = KeptArchives(tmp_path / "restore" / ".kept-archives", logging.getLogger("test"))
    marks.add(old)
    marks.add(fresh)
    two_days_ago = time.time() - 2 * 86400
    os.utime(marks.folder / f"{old.name}.kept", (two_days_ago, two_days_ago))

    cluster = Cluster(tmp_path)
    await cluster.start()  # default limit: one day
    try:
        assert cluster.agent.kept_archive_max_age == 86400
        assert sorted(folder.iterdir()) == sorted([fresh, admins])  # swept at start
        assert cluster.agent.kept_archives.kept() == [fresh]

        # while running: with a limit of 2 s the fresh one goes too, the admin's stays
        cluster.agent.kept_archive_max_age = 2
        cluster.agent._sweeper.cancel()
        cluster.agent._sweeper = asyncio.ensure_future(cluster.agent._sweep_kept_periodically())
        for _ in range(300):
            if not fresh.exists():
                break
            await asyncio.sleep(0.1)
        assert list(folder.iterdir()) == [admins]
        assert cluster.agent.kept_archives.kept() == []
        assert not marks.folder.exists()
    finally:
        await cluster.stop()

    with pytest.raises(TraitError, match="kept_archive_max_age must be 0 or more"):
        cluster.agent.kept_archive_max_age = -1
