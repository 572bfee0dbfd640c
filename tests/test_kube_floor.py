"""The Kubernetes floor (jupyterhub_gpusnap/kube/): one agent-connection setting read by every
hub-side part, one error type, one client for the API server and one for the agents, and
nothing in it imported from above."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import tornado.web
from jupyterhub import orm
from tornado.httpserver import HTTPServer
from tornado.testing import bind_unused_port
from traitlets.config import Config

from jupyterhub_gpusnap import agent as agent_package
from jupyterhub_gpusnap import doctor, kubespawner
from jupyterhub_gpusnap.checkpoint.kubernetes import KubernetesBackend
from jupyterhub_gpusnap.kube import agent as kube_agent
from jupyterhub_gpusnap.kube import api as kube_api
from jupyterhub_gpusnap.kube.agent import AgentConnection, AgentLocator
from jupyterhub_gpusnap.kube.errors import AgentError
from jupyterhub_gpusnap.signals.agent import AgentSignal

PACKAGE = Path(__file__).resolve().parent.parent / "jupyterhub_gpusnap"


def spawner(config: Config) -> kubespawner.SnapKubeSpawner:
    user = SimpleNamespace(name="alice", id=7, url="/user/alice/")
    hub = SimpleNamespace(
        api_url="http://hub:8081/hub/api", base_url="/hub/", url="", public_host=""
    )
    return kubespawner.SnapKubeSpawner(
        config=config, user=user, hub=hub, orm_spawner=orm.Spawner(name=""), _mock=True
    )


KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "http://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


async def test_agent_settings_are_set_once_for_service_spawner_and_doctor(tmp_path, monkeypatch):
    import kubernetes_asyncio.config.kube_config as kc

    (tmp_path / "kubeconfig").write_text(KUBECONFIG)
    monkeypatch.setattr(kc, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    c = Config()
    c.AgentConnection.agent_namespace = "agents"
    c.AgentConnection.agent_port = 9911
    c.AgentConnection.agent_api_token = "s3cret"
    c.SnapKubeSpawner.k8s_api_host = "http://127.0.0.1:1"
    readers = {
        "backend": KubernetesBackend(config=c).locator,
        "signal": AgentSignal(config=c).locator,
        "spawner": spawner(c).checkpoint_backend.locator,
        "doctor": AgentConnection(parent=doctor.Doctor(config=c)),
    }
    for who, conn in readers.items():
        assert isinstance(conn, AgentConnection), who
        assert (conn.agent_namespace, conn.agent_port, conn.token()) == (
            "agents",
            9911,
            "s3cret",
        ), who
    # the doctor's command-line flags set the same settings
    app = doctor.DoctorApp()
    app.initialize(["--agent-namespace=agents", "--agent-port=9912", "--agent-token=t"])
    conn = AgentConnection(parent=doctor.Doctor(parent=app))
    assert (conn.agent_namespace, conn.agent_port, conn.token()) == ("agents", 9912, "t")


def test_one_agent_namespace_default_the_helm_values_one():
    assert AgentConnection.agent_namespace.default_value == "gpusnap-system"
    assert AgentLocator().agent_namespace == "gpusnap-system"
    for cls in (kubespawner.SnapKubeSpawner, doctor.Doctor, AgentLocator):
        assert "agent_namespace" not in cls.class_own_traits(), cls


def test_one_agent_error_and_no_second_client():
    assert kubespawner.AgentError is AgentError
    assert not hasattr(agent_package, "AgentError")
    assert not hasattr(doctor, "KubeREST")
    for name in ("call_agent", "agent_token", "_call_agent_once"):
        assert not hasattr(kubespawner, name), name
    assert kube_api.KubeAPI is doctor.KubeAPI


def test_kube_imports_nothing_above_it():
    """kube/ may use the standard library, third-party packages, itself, and the two
    other bottom-floor modules (retry, and model for type hints)."""
    allowed = {"retry", "model"}
    for path in sorted((PACKAGE / "kube").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 2:
                assert node.module in allowed, f"{path.name} imports ..{node.module}"
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert not (node.module or "").startswith("jupyterhub_gpusnap"), path.name


class Agent(tornado.web.RequestHandler):
    def get(self, what):
        if self.request.headers.get("Authorization") != "Bearer s3cret":
            self.set_status(401)
            self.finish({"error": "wrong token", "fix": "use the agent's shared secret"})
        elif what == "busy":
            self.set_status(500)
            self.finish({"error": "GPU busy", "fix": "try later"})
        else:
            self.finish({"ok": True})


@pytest.fixture
async def agent_url():
    sock, port = bind_unused_port()
    server = HTTPServer(tornado.web.Application([(r"/(\w+)", Agent)]))
    server.add_sockets([sock])
    yield f"http://127.0.0.1:{port}"
    server.stop()


async def test_the_one_agent_client_answers_and_fails_with_the_agents_words(agent_url, tmp_path):
    conn = AgentConnection(agent_api_token="s3cret")
    assert await conn.call(agent_url, "GET", "/healthz") == {"ok": True}
    with pytest.raises(AgentError) as e:
        await conn.call(agent_url, "GET", "/busy")
    assert (e.value.code, e.value.message, e.value.fix) == (500, "GPU busy", "try later")
    assert e.value.transient  # the agent's own 5xx to a GET: a periodic read may try again
    with pytest.raises(AgentError) as e:
        await AgentConnection(agent_api_token="wrong").call(agent_url, "GET", "/healthz")
    assert e.value.code == 401 and not e.value.transient
    # a token file wins over the shared secret; a missing one names the setting
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    assert await AgentConnection(agent_api_token="x", agent_token_file=str(token)).call(
        agent_url, "GET", "/healthz"
    ) == {"ok": True}
    with pytest.raises(AgentError, match="AgentConnection.agent_api_token"):
        AgentConnection(agent_token_file=str(tmp_path / "absent")).token()


async def test_agent_url_template_with_the_nodes_address():
    conn = AgentConnection(agent_url_template="http://{host_ip}:9780/{node}")
    assert await conn.agent_url("gpu-1", "10.0.0.7") == "http://10.0.0.7:9780/gpu-1"
    pod = {"spec": {"nodeName": "gpu-2"}, "status": {"podIP": "10.1.0.3", "hostIP": "10.0.0.8"}}
    assert conn.url_of(pod) == "http://10.0.0.8:9780/gpu-2"
    assert AgentConnection(agent_port=1).url_of(pod) == "http://10.1.0.3:1"
    assert kube_agent.safe_name("Alice@Example.com") == "alice-example-com"
