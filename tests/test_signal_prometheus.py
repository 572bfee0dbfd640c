"""PrometheusSignal against a real HTTP server speaking the Prometheus query API."""

from __future__ import annotations

import json

import pytest

from jupyterhub_gpusnap.model import Server
from jupyterhub_gpusnap.signals.prometheus import PrometheusSignal, escape, pod_name
from tests.helpers.fake_prometheus import FakePrometheus

NOW = 1_800_000_000.0


@pytest.fixture
async def prom():
    fake = FakePrometheus()
    fake.start()
    yield fake
    fake.stop()


def source(prom: FakePrometheus, **kwargs) -> PrometheusSignal:
    return PrometheusSignal(url=prom.url, namespace="jhub", **kwargs)


def gpu_pod(prom: FakePrometheus, pod: str, ratio: float, mib: float, gpu: str = "0", **extra):
    labels = {"pod": pod, "namespace": "jhub", "gpu": gpu, **extra}
    prom.add("DCGM_FI_PROF_GR_ENGINE_ACTIVE", ratio, **labels)
    prom.add("DCGM_FI_DEV_GPU_UTIL", ratio * 100, **labels)
    prom.add("DCGM_FI_DEV_FB_USED", mib, **labels)


def cpu_pod(prom: FakePrometheus, pod: str, cores: float, container: str = "notebook"):
    prom.add(
        "container_cpu_usage_seconds_total", cores, pod=pod, namespace="jhub", container=container
    )


@pytest.mark.parametrize(
    "name, escaped",
    [
        # KubeSpawner's escape scheme, as its documentation lists them
        ("username", "username"),
        ("has-hyphen", "has-2dhyphen"),
        ("Capital", "-43apital"),
        ("user@email.com", "user-40email-2ecom"),
        ("ALLCAPS", "-41-4c-4c-43-41-50-53"),
        ("user@example.com", "user-40example-2ecom"),
        ("fö", "f-c3-b6"),  # UTF-8 bytes, each escaped
        ("", ""),
    ],
)
def test_escape_matches_kubespawner(name, escaped):
    assert escape(name) == escaped


def test_pod_names_of_default_and_named_servers():
    template = PrometheusSignal().pod_name_template
    assert pod_name(template, "user@example.com") == "jupyter-user-40example-2ecom"
    assert pod_name(template, "alice") == "jupyter-alice"
    assert pod_name(template, "alice", "gpu") == "jupyter-alice--gpu"
    assert pod_name(template, "alice", "My GPU") == "jupyter-alice---4dy-20-47-50-55"
    assert pod_name("jupyter-{user_server}", "bob", "x.y") == "jupyter-bob--x-2ey"
    signal = PrometheusSignal(pod_name_template=lambda server: f"nb-{server.user}")
    assert signal.pod_name(Server(user="carol")) == "nb-carol"


async def test_read_single_pod_fills_gpu_memory_and_cpu(prom):
    gpu_pod(prom, "jupyter-alice", 0.42, 2560)
    gpu_pod(prom, "jupyter-alice", 0.05, 1024, gpu="1")
    cpu_pod(prom, "jupyter-alice", 0.3)
    cpu_pod(prom, "jupyter-alice", 0.2, container="sidecar")
    gpu_pod(prom, "jupyter-alice", 0.99, 100, namespace="other")  # same name, other namespace

    sample = await source(prom).sample(Server(user="alice", url="/user/alice/"), NOW)

    assert sample.errors == {}
    assert sample.time == NOW
    assert sample.gpu_percent == pytest.approx(42.0)  # busiest GPU, ratio as percent
    assert sample.gpu_memory_bytes == (2560 + 1024) * 1024 * 1024
    assert sample.gpu_count == 2
    assert sample.cpu_percent == pytest.approx(50.0)
    assert sample.kernels is None and sample.terminals is None
    # the exact queries asked
    assert prom.queries[0] == (
        'max by (pod) (DCGM_FI_PROF_GR_ENGINE_ACTIVE{namespace="jhub",pod="jupyter-alice"}) * 100'
    )
    assert (
        'sum by (pod) (rate(container_cpu_usage_seconds_total{namespace="jhub",pod="jupyter-alice",'
        'container!="",container!="POD"}[2m])) * 100'
    ) in prom.queries
    assert not any("DCGM_FI_DEV_GPU_UTIL" in q for q in prom.queries)  # no fallback needed


async def test_gpu_util_fallback_when_profiling_metrics_are_missing(prom):
    labels = {"pod": "jupyter-bob--gpu", "namespace": "jhub", "gpu": "0"}
    prom.add("DCGM_FI_DEV_GPU_UTIL", 73, **labels)  # percent already
    prom.add("DCGM_FI_DEV_FB_USED", 512, **labels)

    server = Server(user="bob", name="gpu", url="/user/bob/gpu/")
    sample = await source(prom).sample(server, NOW)

    assert sample.errors == {}
    assert sample.gpu_percent == pytest.approx(73.0)
    assert sample.gpu_memory_bytes == 512 * 1024 * 1024
    assert sample.cpu_percent is None  # no cAdvisor series: nothing to say, not "idle"
    assert any(q.startswith("max by (pod) (DCGM_FI_DEV_GPU_UTIL{") for q in prom.queries)


async def test_prefetch_asks_one_query_per_metric_for_all_pods(prom):
    servers = [
        Server(user="alice", url="/user/alice/"),
        Server(user="user@example.com", url="/user/user@example.com/"),
        Server(user="bob", name="gpu", url="/user/bob/gpu/"),
    ]
    gpu_pod(prom, "jupyter-alice", 0.0, 2500)
    gpu_pod(prom, "jupyter-user-40example-2ecom", 0.9, 4000)
    cpu_pod(prom, "jupyter-alice", 0.01)
    cpu_pod(prom, "jupyter-user-40example-2ecom", 1.5)
    prom.add("DCGM_FI_DEV_GPU_UTIL", 12, pod="jupyter-bob--gpu", namespace="jhub", gpu="0")
    cpu_pod(prom, "jupyter-bob--gpu", 0.0)
    signal = source(prom)

    await signal.prefetch(servers)
    asked = len(prom.queries)
    samples = [await signal.sample(s, NOW) for s in servers]

    assert len(prom.queries) == asked == 5  # gpu, fallback for bob, memory, count, cpu
    pods = 'pod=~"jupyter-alice|jupyter-bob--gpu|jupyter-user-40example-2ecom"'
    assert prom.queries[0] == (
        f'max by (pod) (DCGM_FI_PROF_GR_ENGINE_ACTIVE{{namespace="jhub",{pods}}}) * 100'
    )
    assert prom.queries[1] == (
        'max by (pod) (DCGM_FI_DEV_GPU_UTIL{namespace="jhub",pod="jupyter-bob--gpu"})'
    )
    alice, other, bob = samples
    assert [s.errors for s in samples] == [{}, {}, {}]
    assert alice.gpu_percent == 0.0 and alice.gpu_memory_bytes == 2500 * 2**20
    assert alice.cpu_percent == pytest.approx(1.0)
    assert other.gpu_percent == pytest.approx(90.0) and other.cpu_percent == pytest.approx(150.0)
    assert bob.gpu_percent == pytest.approx(12.0) and bob.gpu_memory_bytes is None
    assert bob.cpu_percent == 0.0

    # a server the prefetch did not cover is asked alone
    gpu_pod(prom, "jupyter-dave", 0.5, 10)
    dave = await signal.sample(Server(user="dave", url="/user/dave/"), NOW)
    assert dave.gpu_percent == pytest.approx(50.0)
    assert 'pod="jupyter-dave"' in prom.queries[-1]


async def test_exported_pod_label_is_configurable(prom):
    labels = {"exported_pod": "jupyter-erin", "exported_namespace": "jhub", "pod": "dcgm-x1"}
    prom.add("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 0.25, namespace="gpu-operator", **labels)
    signal = source(
        prom, pod_label="exported_pod", namespace_label="exported_namespace", cpu_query=""
    )
    sample = await signal.sample(Server(user="erin"), NOW)
    assert sample.errors == {}
    assert sample.gpu_percent == pytest.approx(25.0)
    assert prom.queries[0] == (
        "max by (exported_pod) (DCGM_FI_PROF_GR_ENGINE_ACTIVE"
        '{exported_namespace="jhub",exported_pod="jupyter-erin"}) * 100'
    )


async def test_unknown_pod_is_an_error_naming_the_settings(prom):
    gpu_pod(prom, "jupyter-alice", 0.1, 1)
    sample = await source(prom).sample(Server(user="zoe"), NOW)
    assert sample.gpu_percent is None and sample.cpu_percent is None
    assert "no series for pod jupyter-zoe in namespace jhub" in sample.errors["prometheus"]
    assert "pod_name_template" in sample.errors["prometheus"]


@pytest.mark.parametrize(
    "code, body, expected",
    [
        (500, b"internal error\n", "HTTP 500"),
        (
            422,
            json.dumps(
                {"status": "error", "errorType": "execution", "error": "query timed out"}
            ).encode(),
            "query timed out",
        ),
        (200, b"<html>not prometheus</html>", "not Prometheus JSON"),
        (200, b'{"status":"success","data":{"resultType":"matrix","result":[]}}', "'matrix'"),
        (
            200,
            b'{"status":"success","data":{"resultType":"vector","result":[{"metric":{}}]}}',
            "malformed vector",
        ),
    ],
)
async def test_broken_answers_are_sample_errors(prom, code, body, expected):
    prom.broken = (code, body)
    sample = await source(prom).sample(Server(user="alice"), NOW)
    assert sample.gpu_percent is None and sample.cpu_percent is None
    assert expected in sample.errors["prometheus"]


async def test_failed_prefetch_costs_one_query_and_errors_each_server(prom):
    prom.broken = (500, b"down")
    servers = [Server(user="alice"), Server(user="bob")]
    signal = source(prom)
    await signal.prefetch(servers)  # does not raise
    samples = [await signal.sample(s, NOW) for s in servers]
    assert len(prom.queries) == 1
    assert all("HTTP 500" in s.errors["prometheus"] for s in samples)

    # the next tick tries again
    prom.broken = None
    gpu_pod(prom, "jupyter-alice", 0.3, 1)
    await signal.prefetch(servers[:1])
    assert (await signal.sample(servers[0], NOW)).gpu_percent == pytest.approx(30.0)


async def test_unreachable_prometheus_is_a_sample_error():
    fake = FakePrometheus()
    fake.start()
    url = fake.url
    fake.stop()
    signal = PrometheusSignal(url=url, request_timeout=2)
    sample = await signal.sample(Server(user="alice"), NOW)
    assert "cannot reach Prometheus" in sample.errors["prometheus"]
