"""SnapKubeSpawner's restore path against the real node agent and a real container runtime.

The whole suspension on Kubernetes, with nothing faked but the API server and the kubelet's
HTTP front (tests/helpers/fake_kube.py): SnapKubeSpawner starts a server whose pod runs as a real
runc container (tests/helpers/oci_runtime.py) with a live kernel; the service's KubernetesBackend
has the real agent (``jupyterhub-gpusnap-agent``, a process started as in production)
checkpoint it through the kubelet and push it to a real registry (Debian's
docker-registry), and records it; the spawner's ``stop()`` finds that record, its next
``start()`` creates the placeholder pod (again a real container), asks the agent to restore
into it over the agent's HTTP API, and returns the placeholder's address, where the same
kernel answers ``x`` with 42.

Pods that KubeSpawner creates through the API are run by :class:`RealKubelet` below: when the
fake API server schedules one, it starts a real container in a pod sandbox of its own (the
pod's UID, the container's ID, the sandbox's IP in the pod status) and deletes it with the
pod. The agent is reached through tests/helpers/fault_proxy.py, a gateway that can fail.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest
from jupyterhub import orm
from tornado.httpclient import AsyncHTTPClient
from traitlets.config import Config

from jupyterhub_gpusnap.checkpoint.kubernetes import KubernetesBackend
from jupyterhub_gpusnap.kubespawner import PLACEHOLDER_ANNOTATION, SnapKubeSpawner
from jupyterhub_gpusnap.model import Server
from tests.helpers import oci_runtime
from tests.helpers.fake_kube import HUB_TOKEN, fake_cluster, validate
from tests.helpers.fault_proxy import Fault, FaultProxy
from tests.helpers.kernel_ws import execute, new_kernel
from tests.helpers.ports import free_port
from tests.helpers.registry import Registry

pytestmark = [pytest.mark.k8s, pytest.mark.criu]

NODE = "cpu-1"  # where the fake scheduler puts a pod without GPUs
TOKEN = "notebook-token"
AGENT_SECRET = "agent-secret-for-the-spawner-test"
#: The image's jupyterhub-singleuser needs a Hub to talk to; the same Jupyter server without
#: it stands for it here, on the pod port and base URL KubeSpawner gives the server.
SERVER = [
    "python3", "-m", "jupyter_server", f"--ServerApp.token={TOKEN}", "--ServerApp.ip=0.0.0.0",
    "--ServerApp.port=8888", "--ServerApp.base_url=/user/alice/", "--allow-root",
    "--ServerApp.open_browser=False",
]  # fmt: skip


class RealKubelet:
    """Runs the pods the fake API server schedules as real runc containers, as a node does.

    A pod whose container has a ``command`` (the placeholder's ``sleep infinity``) runs
    it; a server pod runs :data:`SERVER`. Every pod mounts ``home`` at /home/jovyan (the
    user's volume). Deleting a pod deletes its container and sandbox.
    """

    def __init__(self, kube, root: Path, home: Path):
        self.kube = kube
        self.root = root
        self.home = home
        self.running: dict[tuple[str, str], oci_runtime.Container] = {}
        self._delete = kube.delete_pod
        kube.schedule = self.schedule
        kube.delete_pod = self.delete_pod

    async def schedule(self, ns: str, name: str) -> None:
        await asyncio.sleep(0.05)
        pod = self.kube.pods.get((ns, name))
        if pod is None:
            return
        node = self.kube.pick_node(pod)
        assert node is not None, f"no node fits {ns}/{name}"
        spec = pod["spec"]["containers"][0]
        args = list(spec.get("command") or []) + list(spec.get("args") or [])
        if not spec.get("command"):
            args = SERVER
        container = await asyncio.to_thread(self._run, pod["metadata"]["uid"], args)
        self.running[(ns, name)] = self.kube.containers[(ns, name)] = container
        ip = next(a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP")
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        pod["spec"]["nodeName"] = node["metadata"]["name"]
        pod["status"].update(
            phase="Running",
            hostIP=ip,
            podIP=container.sandbox.ip,
            podIPs=[{"ip": container.sandbox.ip}],
            startTime=started,
            conditions=[
                {"type": "Ready", "status": "True"},
                {"type": "PodScheduled", "status": "True"},
            ],
            containerStatuses=[
                {
                    "name": spec["name"],
                    "image": spec["image"],
                    "imageID": spec["image"],
                    "ready": True,
                    "restartCount": 0,
                    "started": True,
                    "state": {"running": {"startedAt": started}},
                    "containerID": container.status_id,
                }
            ],
        )
        pod["metadata"]["resourceVersion"] = self.kube.next_rv()
        self.kube.notify("MODIFIED", validate(pod))

    def _run(self, uid: str, args: list[str]) -> oci_runtime.Container:
        sandbox = oci_runtime.PodSandbox.new()
        sandbox.uid = uid  # the pod's: the agent finds the container's cgroup by it
        return oci_runtime.Container(self.root, sandbox, args, home=self.home).start()

    def delete_pod(self, ns: str, name: str):
        pod = self._delete(ns, name)
        container = self.running.pop((ns, name), None)
        self.kube.containers.pop((ns, name), None)
        if container is not None:
            container.delete()
            container.sandbox.stop()
        return pod

    def close(self) -> None:
        for container in self.running.values():
            container.delete()
            container.sandbox.stop()
        self.running.clear()


class AgentProcess:
    """``jupyterhub-gpusnap-agent --config=FILE --port=N --node=NODE``, as the DaemonSet runs it:
    this machine's /proc, cgroups and runc state; the fake API server and kubelet."""

    def __init__(self, root: Path, kube, api_token: str):
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        secret = root / "agent-secret"
        secret.write_text(AGENT_SECRET + "\n")
        sa_token = root / "agent-sa-token"
        sa_token.write_text(api_token)
        self.config = root / "agent_config.py"
        self.config.write_text(
            f"c.AgentApp.ip = '127.0.0.1'\n"
            f"c.AgentApp.api_token_file = {str(secret)!r}\n"
            f"c.AgentApp.checkpoint_dir = {str(kube.checkpoints)!r}\n"
            f"c.AgentApp.restore_dir = {str(root / 'restore')!r}\n"
            f"c.AgentApp.criu_path = {oci_runtime.CRIU!r}\n"
            f"c.AgentApp.runtime_state_dirs = [{str(oci_runtime.RUNC_ROOT)!r}]\n"
            f"c.KubeAPI.api_url = {kube.api_url!r}\n"
            f"c.KubeAPI.token_file = {str(sa_token)!r}\n"
            "c.KubeletClient.kubelet_scheme = 'http'\n"
            "c.KubeletClient.kubelet_host = '127.0.0.1'\n"
            f"c.KubeletClient.kubelet_port = {kube.kubelet_port}\n"
            "c.Shipper.registry_scheme = 'http'\n"
            "c.Shipper.chunk_size = 1 << 20\n"
            "c.PodMapper.proc_root = '/proc'\n"
            f"c.PodMapper.cgroup_root = {str(oci_runtime.cgroup_mounts()['unified'])!r}\n"
        )
        self.log = root / "agent.log"
        self.proc: subprocess.Popen | None = None

    async def start(self) -> AgentProcess:
        command = Path(sys.executable).parent / "jupyterhub-gpusnap-agent"
        self._log = open(self.log, "wb")
        self.proc = subprocess.Popen(
            [str(command), f"--config={self.config}", f"--port={self.port}", f"--node={NODE}"],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        for _ in range(300):
            assert self.proc.poll() is None, self.log.read_text()
            try:
                r = await AsyncHTTPClient().fetch(
                    self.url + "/healthz",
                    headers={"Authorization": f"Bearer {AGENT_SECRET}"},
                    raise_error=False,
                )
                if r.code == 200:
                    return self
            except OSError:
                pass
            await asyncio.sleep(0.05)
        raise AssertionError(f"the agent did not answer: {self.log.read_text()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture
def runtime():
    why = oci_runtime.missing()
    assert not why, why  # no skipping: install it (.ci/install-runtime.sh)
    return oci_runtime.image_rootfs()


@pytest.fixture
async def setup(runtime, tmp_path, monkeypatch):
    """The fake cluster whose pods run for real, the real agent behind a gateway, a registry."""
    registry = await Registry(tmp_path / "registry").start()
    async with fake_cluster(tmp_path, monkeypatch) as kube:
        home = tmp_path / "home-pvc"  # the user's volume, mounted by each of their pods
        home.mkdir()
        kubelet = RealKubelet(kube, tmp_path / "pods", home)
        agent = await AgentProcess(
            tmp_path, kube, kube.add_token("system:serviceaccount:gpusnap-system:agent")
        ).start()
        kube.add_agent_pod(NODE, "127.0.0.1")
        gateway = await FaultProxy(agent.url).start()
        try:
            yield SimpleNamespace(
                kube=kube, registry=registry, agent=agent, gateway=gateway, kubelet=kubelet,
                root=tmp_path,
            )  # fmt: skip
        finally:
            kubelet.close()  # the restored tree dies with the placeholder's container
            await gateway.stop()
            agent.stop()
            registry.stop()


def hub_config(s) -> Config:
    """What the hub pod's config sets (helm-values/values.yaml), pointed at this cluster."""
    token = s.root / "hub-sa-token"
    token.write_text(HUB_TOKEN + "\n")
    secret = s.root / "agent-secret"
    c = Config()
    spawner = c.SnapKubeSpawner
    spawner.k8s_api_host = s.kube.url
    spawner.namespace = "jhub"
    spawner.events_enabled = False
    spawner.image = oci_runtime.IMAGE
    spawner.cmd = ["jupyterhub-singleuser"]
    spawner.port = 8888
    spawner.start_timeout = 60
    spawner.k8s_api_request_retry_timeout = 10
    spawner.restore_timeout = 120
    spawner.server_poll_interval = 0.1
    c.AgentConnection.agent_namespace = "gpusnap-system"
    c.AgentConnection.agent_port = (
        s.gateway.port
    )  # the spawner reaches the agent through the gateway
    c.AgentConnection.agent_api_token = AGENT_SECRET
    c.KubeAPI.api_url = s.kube.url
    c.KubeAPI.token_file = str(token)
    c.AgentLocator.namespace = "jhub"
    c.AgentLocator.agent_namespace = "gpusnap-system"
    c.AgentLocator.agent_port = s.gateway.port  # so does the service
    c.AgentLocator.agent_token_file = str(secret)
    c.KubernetesBackend.repository_template = f"{s.registry.host}/gpusnap/{{username}}"
    c.KubernetesBackend.registry_scheme = "http"
    c.KubernetesBackend.timeout = 120
    c.Backoff.retry_backoff = 0.05
    c.Backoff.retry_backoff_max = 0.2
    return c


def make_spawner(config: Config, token: str) -> SnapKubeSpawner:
    user = SimpleNamespace(name="alice", id=7, url="/user/alice/")
    hub = SimpleNamespace(
        api_url="http://hub:8081/hub/api",
        base_url="/hub/",
        url="http://hub:8081/hub/",
        public_host="",
    )
    spawner = SnapKubeSpawner(
        config=config, user=user, hub=hub, orm_spawner=orm.Spawner(name=""), _mock=True
    )
    spawner.api_token = token  # the server's Hub API token
    return spawner


async def start_with_progress(spawner: SnapKubeSpawner) -> tuple[str, list[dict]]:
    events: list[dict] = []
    fut = spawner.start()

    async def collect():
        async for e in spawner.progress():
            events.append(e)

    collector = asyncio.ensure_future(collect())
    url = await fut
    await asyncio.wait_for(collector, 30)
    return url, events


async def test_a_suspended_server_comes_back_through_the_real_agent(setup):
    s = setup
    config = hub_config(s)
    spawner = make_spawner(config, "token-of-the-first-run")

    # a fresh server: its pod runs a real container; the user sets x in a kernel
    url = await spawner.start()
    first = s.kube.pods[("jhub", "jupyter-alice")]
    assert url == f"http://{first['status']['podIP']}:8888"
    base = url + "/user/alice/"
    await oci_runtime.wait_http(base + "api/status", TOKEN)
    kernel = await new_kernel(base, TOKEN)
    out, _ = await execute(base, TOKEN, kernel, "x = 42; print('ready')", timeout=60)
    assert out.strip() == "ready"
    spawner.orm_spawner.started = datetime.now(timezone.utc).replace(tzinfo=None) - timedelta(
        minutes=1
    )

    # the service checkpoints it through the real agent (the gateway refuses the first
    # try), then stops it through the Hub
    s.gateway.faults = [Fault("POST", r"^/v1/checkpoint$", nth=1, status=502)]
    backend = KubernetesBackend(config=config)
    alice = Server(user="alice", name="", state=spawner.get_state())
    info = await backend.checkpoint(alice)
    assert s.gateway.count("POST", r"^/v1/checkpoint$") == 2
    assert s.kube.checkpointed == ["jhub/jupyter-alice/notebook"]  # one checkpoint taken
    assert info.status == "verified" and info.id.startswith(f"{s.registry.host}/gpusnap/alice@")
    await spawner.stop()
    assert ("jhub", "jupyter-alice") not in s.kubelet.running  # its container is gone
    assert spawner.will_resume is True  # the token the kernel's server holds is kept
    spawner.clear_state()
    assert spawner.pending_checkpoint["id"] == info.id

    # the next start: a placeholder pod, restored by the agent; the gateway fails once
    s.gateway.faults = [Fault("POST", r"^/v1/restore$", nth=1, status=502)]
    spawner.api_token = "fresh-token-from-the-hub"
    url, events = await start_with_progress(spawner)

    placeholder = s.kube.created[-1]
    assert placeholder["metadata"]["annotations"][PLACEHOLDER_ANNOTATION] == info.id
    assert placeholder["spec"]["containers"][0]["command"] == ["sleep", "infinity"]
    pod = s.kube.pods[("jhub", "jupyter-alice")]
    assert (
        url == f"http://{pod['status']['podIP']}:8888" != f"http://{first['status']['podIP']}:8888"
    )
    # the gateway's 502 was tried again; the agent itself was asked once
    assert s.gateway.count("POST", r"^/v1/restore$") == 2
    assert [code for m, p, _, code in s.gateway.forwarded if p == "/v1/restore"] == [200]
    # the same kernel answers on the placeholder's address, inside its container
    out, _ = await execute(url + "/user/alice/", TOKEN, kernel, "print(x)", timeout=60)
    assert out.strip() == "42"
    container = s.kubelet.running[("jhub", "jupyter-alice")]
    assert len(container.cgroup_pids()) > 1  # the placeholder's sleep and the restored tree
    assert events[-1]["message"] == "Server restored from its snapshot."
    assert spawner.api_token == "token-of-the-first-run"  # the one the restored server holds
    state = spawner.get_state()["gpusnap"]
    assert state["restored"]["id"] == info.id and "checkpoint" not in state


async def test_an_error_the_agent_answers_is_final_and_a_fresh_server_starts(setup):
    """A gateway's failure is tried again, the agent's own error is not."""
    s = setup
    spawner = make_spawner(hub_config(s), "fresh-token-from-the-hub")
    missing = f"{s.registry.host}/gpusnap/alice@sha256:" + "0" * 64
    spawner.load_state(
        {
            "pod_name": "jupyter-alice",
            "namespace": "jhub",
            "gpusnap": {
                "checkpoint": {
                    "id": missing,
                    "user": "alice",
                    "server_name": "",
                    "created": time.time(),
                    "status": "verified",
                    "image_bytes": 1 << 20,
                    "gpu_count": 0,
                },  # fmt: skip
                "api_token": "token-held-by-the-snapshot",
            },
        }
    )

    s.gateway.faults = [Fault("POST", r"^/v1/restore$", nth=1, status=503)]

    url, events = await start_with_progress(spawner)

    # the gateway's 503 is tried again; the agent's own answer (the image is not in the
    # registry, a 5xx with its error and fix) is final
    assert s.gateway.count("POST", r"^/v1/restore$") == 2
    forwarded = [code for m, p, _, code in s.gateway.forwarded if p == "/v1/restore"]
    assert len(forwarded) == 1 and forwarded[0] >= 500
    messages = " ".join(e["message"] for e in events)
    assert "Could not restore your snapshot" in messages and missing in messages
    assert "fix:" in messages
    # the placeholder went, a fresh server runs with the Hub's new token
    assert [c["spec"]["containers"][0].get("command") for c in s.kube.created] == [
        ["sleep", "infinity"],
        None,
    ]
    assert spawner.api_token == "fresh-token-from-the-hub"
    await oci_runtime.wait_http(url + "/user/alice/api/status", TOKEN)
    state = spawner.get_state()["gpusnap"]
    assert state["failures"][-1]["id"] == missing and "checkpoint" not in state
