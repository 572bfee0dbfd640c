"""SnapKubeSpawner against a wire-level fake Kubernetes API server and node agent.

The fake API server (tests/helpers/fake_kube.py, shared with the agent's tests) is a real tornado
HTTP server answering the exact REST paths KubeSpawner (through kubernetes_asyncio) uses,
with Pod/Status/WatchEvent JSON; every created pod is validated with kubernetes_validate.
Its "scheduler" honours nodeSelector, required node affinity (``In``) and GPU capacity, so
a pod pinned to a GPU model no node has stays Pending, as on a cluster. The fake node
agent is a real HTTP server following the agent contract (``POST /v1/restore`` …); a
successful restore starts a real HTTP server on the pod's port, standing in for the
restored notebook server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import kubernetes_validate
import pytest
from jupyterhub import orm
from traitlets.config import Config

from jupyterhub_gpusnap.checkpoint.base import Restored, RestoreTarget
from jupyterhub_gpusnap.checkpoint.kubernetes import KubernetesBackend
from jupyterhub_gpusnap.kube.agent import AgentConnection
from jupyterhub_gpusnap.kubespawner import (
    PLACEHOLDER_ANNOTATION,
    RESTORED_FROM_ANNOTATION,
    SnapKubeSpawner,
)
from tests.helpers.fake_kube import (
    A100,
    H100,
    HUB_TOKEN,
    K8S_VERSION,
    FakeAgent,
    FakeKube,
    fake_cluster,
    free_port,
    serve_notebook_api,
)

pytestmark = pytest.mark.k8s


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
    # the checkpoint records (the default checkpoint_backend_class): the service's ConfigMaps
    token_file = kube.root / "hub-sa-token"
    token_file.write_text(HUB_TOKEN + "\n")
    c.KubeAPI.api_url = kube.url
    c.KubeAPI.token_file = str(token_file)
    c.AgentLocator.namespace = "jhub"
    # retries without the production waits
    c.Backoff.retry_backoff = 0.01
    c.Backoff.retry_backoff_max = 0.05
    if agent is not None:
        c.AgentConnection.agent_namespace = "gpusnap-system"
        c.AgentConnection.agent_port = agent.port
        c.AgentConnection.agent_api_token = agent.token
    for k, v in traits.items():
        # the agent settings are AgentConnection's, the rest the spawner's
        agent_setting = k in AgentConnection.class_own_traits(config=True)
        setattr(c.AgentConnection if agent_setting else cfg, k, v)
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
    assert ("jhub", "jupyter-alice") in kube.pods
    spawner.orm_spawner.started = datetime.now(timezone.utc).replace(tzinfo=None) - timedelta(
        minutes=5
    )

    # the service records its verified checkpoint (a ConfigMap) before stopping the server
    image = record_configmap(kube, spawner, created=time.time() - 10)

    await spawner.stop()
    assert ("jhub", "jupyter-alice") not in kube.pods
    assert spawner.will_resume is True  # the Hub keeps the API token
    spawner.clear_state()  # as User.stop does
    state = spawner.get_state()
    assert state["gpusnap"]["checkpoint"]["id"] == image
    assert state["gpusnap"]["api_token"] == "fresh-token-from-hub"
    # what the checkpoint ran on, for the restore's placement
    assert state["gpusnap"]["checkpoint"]["gpu_model"] == A100
    assert state["gpusnap"]["checkpoint"]["gpu_count"] == 1

    # a new spawner object (after a hub restart) loads it from the database
    again = make_spawner(kube)
    again.load_state(json.loads(json.dumps(state)))
    again.clear_state()  # as User.spawn does before start
    assert again.pending_checkpoint["id"] == image
    assert again.will_resume is True


async def test_stop_without_checkpoint_forgets_token(kube):
    spawner = make_spawner(kube)
    await spawner.start()
    await spawner.stop()
    spawner.clear_state()
    assert spawner.will_resume is False
    assert "gpusnap" not in spawner.get_state()


async def test_unverified_checkpoint_record_is_ignored(kube):
    spawner = make_spawner(kube)
    await spawner.start()
    spawner.orm_spawner.started = datetime.now(timezone.utc).replace(tzinfo=None) - timedelta(
        minutes=5
    )
    record_configmap(kube, spawner, created=time.time() - 10, status="writing")
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
    assert kube.pods[("jhub", "jupyter-alice")]["spec"]["nodeName"] == "gpu-h100"

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
    fresh = kube.pods[("jhub", "jupyter-alice")]
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
    assert kube.pods[("jhub", "jupyter-alice")]["spec"]["nodeName"] in ("gpu-a100", "gpu-h100")
    assert not [r for r in agent.requests if r[1] == "/v1/restore"]
    messages = " ".join(e["message"] for e in events)
    assert "NVIDIA-B200" in messages
    assert "did not finish within 1.5s" in messages


async def test_no_agent_on_the_node_falls_back_with_fix(kube, agent):
    del kube.pods[("gpusnap-system", "gpusnap-agent-gpu-h100")]
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
    assert "command" not in container(kube.pods[("jhub", "jupyter-alice")])


async def test_agent_unreachable_falls_back_with_fix(kube, agent):
    info = checkpoint()
    spawner = make_spawner(kube, agent, agent_port=free_port())
    spawner.load_state(suspended_state(info))
    url, events = await start_with_progress(spawner)
    messages = " ".join(e["message"] for e in events)
    assert "node agent" in messages and "DaemonSet" in messages
    assert spawner.api_token == "fresh-token-from-hub"
    assert "command" not in container(kube.pods[("jhub", "jupyter-alice")])


async def test_stop_finds_checkpoint_through_kubernetes_backend(kube, tmp_path):
    """The service's KubernetesBackend records checkpoints in ConfigMaps; stop() finds the new one."""
    from jupyterhub_gpusnap.checkpoint.base import CheckpointInfo
    from jupyterhub_gpusnap.checkpoint.kubernetes import KubernetesBackend

    token_file = tmp_path / "sa-token"
    token_file.write_text(HUB_TOKEN + "\n")
    spawner = make_spawner(kube, checkpoint_backend_class=KubernetesBackend)
    spawner.config.KubeAPI.api_url = kube.url
    spawner.config.KubeAPI.token_file = str(token_file)
    spawner.config.AgentLocator.namespace = "jhub"
    await spawner.start()
    assert kube.pods[("jhub", "jupyter-alice")]["spec"]["nodeName"] == "gpu-a100"
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
        kube.add_configmap(cm)

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
    token_file.write_text(HUB_TOKEN + "\n")
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
    kube.add_configmap(cm)
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
    record_configmap(kube, spawner, created=time.time() - 3600)
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


# ---------------------------------------------------------------- lookup failures on stop


def backend_spawner(kube, tmp_path, api_url: str, agent=None, **traits) -> SnapKubeSpawner:
    """A spawner consulting the KubernetesBackend (ConfigMaps) through ``api_url``."""
    from jupyterhub_gpusnap.checkpoint.kubernetes import KubernetesBackend

    token_file = tmp_path / "sa-token"
    token_file.write_text(HUB_TOKEN + "\n")
    spawner = make_spawner(kube, agent, checkpoint_backend_class=KubernetesBackend, **traits)
    spawner.config.KubeAPI.api_url = api_url
    spawner.config.KubeAPI.token_file = str(token_file)
    spawner.config.AgentLocator.namespace = "jhub"
    return spawner


def record_configmap(
    kube, spawner, created: float, digest: str = "44", status: str = "verified"
) -> str:
    """The service's record of a checkpoint (as KubernetesBackend writes it)."""
    from jupyterhub_gpusnap.checkpoint.base import CheckpointInfo
    from jupyterhub_gpusnap.checkpoint.kubernetes import KubernetesBackend

    info = CheckpointInfo(
        id=f"registry.example.org/gpusnap/alice-default@sha256:{digest * 32}",
        user="alice",
        server_name="",
        created=created,
        status=status,
        image_bytes=2 * 1024**3,
    )
    cm = KubernetesBackend(config=spawner.config)._configmap(info)
    cm["metadata"]["namespace"] = "jhub"
    kubernetes_validate.validate(cm, K8S_VERSION, strict=True)
    kube.add_configmap(cm)
    return info.id


def lookup_failures(phase: str) -> float:
    from prometheus_client import REGISTRY

    return (
        REGISTRY.get_sample_value(
            "gpusnap_spawner_checkpoint_lookup_failures_total", {"phase": phase}
        )
        or 0.0
    )


async def test_stop_with_backend_unreachable_leaves_the_server_restorable(
    kube, agent, tmp_path, caplog
):
    dead = f"http://127.0.0.1:{free_port()}"  # the checkpoint records cannot be read
    spawner = backend_spawner(kube, tmp_path, dead)
    spawner.api_token = "token-of-the-stopped-run"
    await spawner.start()
    started = time.time() - 60
    spawner.orm_spawner.started = datetime.fromtimestamp(started, timezone.utc).replace(tzinfo=None)
    before = lookup_failures("stop")

    await spawner.stop()

    # the stop was honoured, but nothing that would make a snapshot unrestorable happened
    assert ("jhub", "jupyter-alice") not in kube.pods
    assert spawner.will_resume is True  # the Hub keeps the token a checkpoint would hold
    assert lookup_failures("stop") == before + 1
    assert "cannot tell whether the server has a checkpoint" in caplog.text
    assert "checkpoint backend lookup failed" in caplog.text
    spawner.clear_state()
    state = json.loads(json.dumps(spawner.get_state()))
    lookup = state["gpusnap"]["lookup"]
    assert "checkpoint backend lookup failed" in lookup["error"]
    assert lookup["started"] == pytest.approx(started, abs=1)
    assert state["gpusnap"]["api_token"] == "token-of-the-stopped-run"

    # the service had checkpointed this run; the backend is reachable again at the next start
    image = record_configmap(kube, spawner, created=started + 30)
    again = backend_spawner(kube, tmp_path, kube.url, agent)
    again.load_state(state)
    again.clear_state()
    assert again.will_resume is True
    url, events = await start_with_progress(again)

    restores = [b for m, u, b in agent.requests if u == "/v1/restore"]
    assert [b["image"] for b in restores] == [image]
    assert again.api_token == "token-of-the-stopped-run"  # held by the restored processes
    assert "lookup" not in again.get_state()["gpusnap"]
    assert events[-1]["message"] == "Server restored from its snapshot."


async def test_start_refuses_to_pass_over_a_snapshot_while_the_lookup_fails(kube, agent, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    state = {
        "pod_name": "jupyter-alice",
        "namespace": "jhub",
        "gpusnap": {
            "lookup": {"error": "x", "started": time.time() - 600, "stopped": time.time() - 60},
            "api_token": "old-token-held-by-the-processes",
        },
    }
    spawner = backend_spawner(kube, tmp_path, dead, agent)
    spawner.load_state(json.loads(json.dumps(state)))
    before = lookup_failures("start")
    with pytest.raises(Exception, match="Cannot tell whether your server has a snapshot"):
        await spawner.start()
    assert kube.created == []  # no fresh pod over a possible snapshot
    assert lookup_failures("start") == before + 1
    assert (
        spawner.get_state()["gpusnap"]["lookup"]["stopped"] == state["gpusnap"]["lookup"]["stopped"]
    )

    # past checkpoint_lookup_retry_seconds it gives up and starts fresh
    late = backend_spawner(kube, tmp_path, dead, agent, checkpoint_lookup_retry_seconds=30)
    late.load_state(json.loads(json.dumps(state)))
    url, events = await start_with_progress(late)
    assert [container(p).get("command") for p in kube.created] == [None]
    assert late.api_token == "fresh-token-from-hub" and late.will_resume is False
    assert "gpusnap" not in late.get_state()
    assert not [r for r in agent.requests if r[1] == "/v1/restore"]


async def test_second_lookup_finding_nothing_starts_fresh(kube, agent, tmp_path):
    state = {
        "pod_name": "jupyter-alice",
        "namespace": "jhub",
        "gpusnap": {
            "lookup": {"error": "x", "started": time.time() - 600, "stopped": time.time() - 60},
            "api_token": "old-token-held-by-the-processes",
        },
    }
    spawner = backend_spawner(kube, tmp_path, kube.url, agent)
    # a record of an earlier run only: not this run's, not restored
    record_configmap(kube, spawner, created=time.time() - 7200)
    spawner.load_state(json.loads(json.dumps(state)))
    await start_with_progress(spawner)
    assert [container(p).get("command") for p in kube.created] == [None]
    assert spawner.api_token == "fresh-token-from-hub" and spawner.will_resume is False
    assert "gpusnap" not in spawner.get_state()
    assert not [r for r in agent.requests if r[1] == "/v1/restore"]


# ---------------------------------------------------------------- the one restore contract


class RecordingBackend(KubernetesBackend):
    """The Kubernetes backend, noting each restore asked of it and what it returned."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.restores: list[tuple[str, float, RestoreTarget | None]] = []
        self.restored: list[Restored] = []

    async def restore(self, info, timeout=600.0, into=None):
        self.restores.append((info.id, timeout, into))
        self.restored.append(await super().restore(info, timeout=timeout, into=into))
        return self.restored[-1]


async def test_agent_restore_is_the_backends_restore_into_the_placeholder(kube, agent):
    """The spawner asks its checkpoint backend to restore into the placeholder pod (the
    one restore contract); the backend's agent client makes the call."""
    info = checkpoint()
    spawner = make_spawner(
        kube, agent, checkpoint_backend_class=RecordingBackend, agent_request_timeout=321
    )
    spawner.load_state(suspended_state(info))

    url, events = await start_with_progress(spawner)

    backend = spawner.checkpoint_backend
    assert backend.restores == [
        (info["id"], 321, RestoreTarget("jhub", "jupyter-alice", "notebook"))
    ]
    assert [(r.pid, r.node) for r in backend.restored] == [(4242, "gpu-h100")]
    restores = [r for r in agent.requests if r[1] == "/v1/restore"]
    assert [b["image"] for m, u, b in restores] == [info["id"]]
    assert spawner.api_token == "old-token-held-by-the-processes"
    assert events[-1]["message"] == "Server restored from its snapshot."


async def test_an_answer_that_is_no_restore_falls_back_naming_the_node(kube, agent):
    """An agent that answers without ``restored``: the restore failed on that node."""
    import tornado.web
    from tornado.httpserver import HTTPServer
    from tornado.testing import bind_unused_port

    class NotRestored(tornado.web.RequestHandler):
        def post(self):
            self.finish({"restored": False})

    sock, port = bind_unused_port()
    server = HTTPServer(tornado.web.Application([(r"/v1/restore", NotRestored)]))
    server.add_sockets([sock])
    try:
        spawner = make_spawner(kube, agent, agent_port=port)
        spawner.load_state(suspended_state(checkpoint()))
        url, events = await start_with_progress(spawner)
    finally:
        server.stop()
    messages = " ".join(e["message"] for e in events)
    assert "node agent on gpu-h100 did not restore: {'restored': False}" in messages
    assert spawner.api_token == "fresh-token-from-hub"
    assert [container(p).get("command") for p in kube.created] == [["sleep", "infinity"], None]
