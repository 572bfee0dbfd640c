"""The hub side's API-server calls through a gateway that fails (tests/fault_proxy.py in front
of the wire-level fake API server): what fails for a moment (no answer, 5xx) is tried again
with backoff, a 4xx never is; a create or delete whose answer was lost is not done twice."""

from __future__ import annotations

import time

import pytest
from fake_kube import HUB_USER, FakeKube
from fault_proxy import Fault, FaultProxy
from traitlets.config import Config

from jupyterhub_gpusnap.agent.errors import AgentError
from jupyterhub_gpusnap.checkpoint.base import CheckpointInfo
from jupyterhub_gpusnap.checkpoint.kubernetes import KubernetesBackend

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
    c.Backoff.first_delay = 0.01
    c.Backoff.max_delay = 0.05
    c.Backoff.attempts = 4
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
