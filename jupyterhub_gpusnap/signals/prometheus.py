"""GPU and CPU activity of Kubernetes pods, from a Prometheus that scrapes DCGM exporter and cAdvisor.

For clusters that already run NVIDIA's DCGM exporter and cAdvisor (the
kubelet's ``/metrics/cadvisor``): no node agent is needed. Pods are found by
their name, computed like KubeSpawner's ``pod_name_template`` with its
``escape`` slug scheme, and the namespace. Once per tick :meth:`prefetch` asks
one instant query per metric for all pods at once; :meth:`read` then picks its
pod from that answer, or asks for its pod alone when nothing was prefetched.
"""

from __future__ import annotations

import json
import math
import re
import string
from collections.abc import Iterable
from dataclasses import dataclass, field
from string import Template
from urllib.parse import urlencode

from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from traitlets import Callable as CallableTrait
from traitlets import Dict, Float, Unicode, Union

from ..model import Sample, Server
from .base import SignalSource

_SAFE = set(string.ascii_lowercase + string.digits)


def escape(name: str) -> str:
    """KubeSpawner's ``escape`` slug: non-``[a-z0-9]`` characters become ``-XX`` (UTF-8 hex), then lower-case.

    ``"user@example.com"`` → ``"user-40example-2ecom"``, ``"has-hyphen"`` → ``"has-2dhyphen"``.
    """
    out = []
    for char in name:
        if char in _SAFE:
            out.append(char)
        else:
            out.extend(f"-{byte:02X}" for byte in char.encode("utf-8"))
    return "".join(out).lower()


def pod_name(template: str, user: str, server_name: str = "") -> str:
    """Render a KubeSpawner-style ``pod_name_template`` (escape scheme) for one server.

    Fields: ``username``, ``servername``, ``user_server`` (escaped), ``escaped_*`` (same),
    ``unescaped_username``, ``unescaped_servername``. As KubeSpawner does, trailing ``-``
    left by an empty server name are stripped (``jupyter-alice--`` → ``jupyter-alice``).
    """
    username, servername = escape(user), escape(server_name)
    user_server = f"{username}--{servername}" if servername else username
    rendered = template.format(
        username=username,
        servername=servername,
        user_server=user_server,
        escaped_username=username,
        escaped_servername=servername,
        escaped_user_server=f"{username}--{servername}",
        unescaped_username=user,
        unescaped_servername=server_name,
    )
    return rendered if template.endswith("-") else rendered.rstrip("-")


def _promql_string(value: str) -> str:
    """``value`` as a double-quoted PromQL string literal."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _regex_alternation(names: Iterable[str]) -> str:
    """An RE2 pattern matching exactly one of ``names``."""
    return "|".join(re.sub(r"([.^$*+?()\[\]{}|\\])", r"\\\1", n) for n in sorted(set(names)))


class PrometheusError(RuntimeError):
    """Prometheus did not answer a query with a vector."""


@dataclass
class PodMetrics:
    """What one pod's series said in one tick."""

    gpu_percent: float | None = None
    gpu_memory_bytes: int | None = None
    gpu_count: int | None = None
    cpu_percent: float | None = None
    seen: bool = False  # any series at all named this pod

    def sample(self, now: float) -> Sample:
        return Sample(
            time=now,
            gpu_percent=self.gpu_percent,
            gpu_memory_bytes=self.gpu_memory_bytes,
            gpu_count=self.gpu_count,
            cpu_percent=self.cpu_percent,
        )


@dataclass
class _Prefetched:
    pods: dict[str, PodMetrics] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)  # pods whose prefetch failed with ``error``
    error: str | None = None


class PrometheusSignal(SignalSource):
    """GPU utilisation, GPU memory and CPU of KubeSpawner pods, from Prometheus.

    Queries are PromQL templates: ``$selector`` becomes the label matchers for
    the pods asked about (``namespace="jhub",pod=~"jupyter-alice|jupyter-bob"``)
    and ``$pod_label`` the label that names the pod. Each query must keep that
    label in its result (aggregate ``by ($pod_label)``); several series for one
    pod are combined (the busiest GPU, the sum of memory, GPUs and CPU).
    """

    name = "prometheus"

    url = Unicode(
        "http://prometheus-server.monitoring.svc",
        help="""Base URL of the Prometheus HTTP API, without ``/api/v1``, e.g.
        ``http://prometheus-operated.monitoring.svc:9090`` or a Thanos/Mimir query frontend
        that serves ``/api/v1/query``.""",
    ).tag(config=True)

    headers = Dict(
        {},
        help="""Extra HTTP headers sent with every query, e.g.
        ``{"Authorization": "Bearer <token>"}`` or ``{"X-Scope-OrgID": "tenant"}`` for Mimir.""",
    ).tag(config=True)

    namespace = Unicode(
        "jhub",
        help="""Kubernetes namespace of the user pods (KubeSpawner's ``namespace``).
        Empty matches pods of that name in any namespace.""",
    ).tag(config=True)

    pod_name_template = Union(
        [Unicode(), CallableTrait()],
        default_value="jupyter-{username}--{servername}",
        help="""Name of a server's pod, as KubeSpawner's ``pod_name_template`` with the
        ``escape`` slug scheme: ``{username}`` and ``{servername}`` are escaped (non-``[a-z0-9]``
        → ``-XX`` hex, e.g. ``user@example.com`` → ``user-40example-2ecom``), and a trailing
        ``--`` is dropped for the default server, so ``jupyter-alice`` and ``jupyter-alice--gpu``.
        ``{user_server}`` and ``{unescaped_username}`` work too. For KubeSpawner's ``safe`` slug
        scheme or anything else, give a callable ``f(server) -> str`` taking a
        :class:`jupyterhub_gpusnap.model.Server`.""",
    ).tag(config=True)

    pod_label = Unicode(
        "pod",
        help="""Label that holds the pod name on DCGM exporter series. ``pod`` when DCGM exporter
        runs with ``--kubernetes`` and Prometheus keeps its labels (``honor_labels``); often
        ``exported_pod`` when Prometheus renamed it because the exporter's own pod has one.""",
    ).tag(config=True)

    namespace_label = Unicode(
        "namespace",
        help="""Label that holds the pod's namespace on DCGM exporter series
        (``namespace`` or ``exported_namespace``, as for ``pod_label``).""",
    ).tag(config=True)

    cpu_pod_label = Unicode(
        "pod",
        help="Label that holds the pod name on cAdvisor series (``pod`` with the kubelet's cAdvisor).",
    ).tag(config=True)

    cpu_namespace_label = Unicode(
        "namespace",
        help="Label that holds the namespace on cAdvisor series.",
    ).tag(config=True)

    gpu_query = Unicode(
        "max by ($pod_label) (DCGM_FI_PROF_GR_ENGINE_ACTIVE{$selector}) * 100",
        help="""PromQL for the GPU utilisation percent of each pod (its busiest GPU).
        ``DCGM_FI_PROF_GR_ENGINE_ACTIVE`` is the fraction of time the graphics engine ran a
        kernel (0–1, hence ``* 100``); it needs DCGM profiling metrics, which some GPUs and
        MIG setups lack — then ``gpu_fallback_query`` is asked for the pods it had no series for.""",
    ).tag(config=True)

    gpu_fallback_query = Unicode(
        "max by ($pod_label) (DCGM_FI_DEV_GPU_UTIL{$selector})",
        help="""PromQL for the GPU utilisation percent of pods ``gpu_query`` had nothing for.
        ``DCGM_FI_DEV_GPU_UTIL`` is already a percent. Empty to ask nothing more.""",
    ).tag(config=True)

    memory_query = Unicode(
        "sum by ($pod_label) (DCGM_FI_DEV_FB_USED{$selector}) * 1048576",
        help="""PromQL for the GPU memory each pod holds, in bytes (``DCGM_FI_DEV_FB_USED`` is MiB).
        Memory held is reported, never counted as activity. Empty to skip.""",
    ).tag(config=True)

    gpu_count_query = Unicode(
        "count by ($pod_label) (DCGM_FI_DEV_FB_USED{$selector})",
        help="PromQL for the number of GPUs attached to each pod. Empty to skip.",
    ).tag(config=True)

    cpu_query = Unicode(
        'sum by ($pod_label) (rate(container_cpu_usage_seconds_total{$selector,container!="",container!="POD"}[2m])) * 100',
        help="""PromQL for the CPU use of each pod in percent of one core, from cAdvisor's
        ``container_cpu_usage_seconds_total``. The ``[2m]`` window must cover at least two
        scrapes; widen it when Prometheus scrapes less often than every minute. Empty to skip.""",
    ).tag(config=True)

    request_timeout = Float(
        10.0,
        help="Seconds one query to Prometheus may take (connect and answer).",
    ).tag(config=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._prefetched: _Prefetched | None = None

    # -- naming -----------------------------------------------------------------

    def pod_name(self, server: Server) -> str:
        """The name of ``server``'s pod."""
        template = self.pod_name_template
        if callable(template):
            return template(server)
        return pod_name(template, server.user, server.name)

    def _selector(self, pods: list[str], pod_label: str, namespace_label: str) -> str:
        matchers = []
        if self.namespace:
            matchers.append(f"{namespace_label}={_promql_string(self.namespace)}")
        if len(pods) == 1:
            matchers.append(f"{pod_label}={_promql_string(pods[0])}")
        else:
            matchers.append(f"{pod_label}=~{_promql_string(_regex_alternation(pods))}")
        return ",".join(matchers)

    # -- HTTP -------------------------------------------------------------------

    async def query(self, promql: str) -> list[tuple[dict, float]]:
        """Run one instant query; return ``(labels, value)`` for each series of the vector."""
        url = f"{self.url.rstrip('/')}/api/v1/query?{urlencode({'query': promql})}"
        request = HTTPRequest(
            url,
            headers={"Accept": "application/json", **self.headers},
            connect_timeout=self.request_timeout,
            request_timeout=self.request_timeout,
        )
        try:
            response = await AsyncHTTPClient().fetch(request, raise_error=False)
        except OSError as e:  # refused, unresolvable: raised even with raise_error=False
            raise PrometheusError(f"cannot reach Prometheus at {self.url}: {e}") from None
        if response.code == 599:
            raise PrometheusError(f"cannot reach Prometheus at {self.url}: {response.error}")
        try:
            body = json.loads(response.body or b"")
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise PrometheusError(
                f"Prometheus at {self.url} answered HTTP {response.code} with a body that is not "
                "Prometheus JSON; check PrometheusSignal.url points at the Prometheus API"
            )
        if response.code != 200 or body.get("status") != "success":
            why = body.get("error") or response.reason
            raise PrometheusError(
                f"Prometheus query failed (HTTP {response.code}, {body.get('errorType', 'error')}): "
                f"{why}; query: {promql}"
            )
        data = body.get("data")
        if not isinstance(data, dict) or data.get("resultType") != "vector":
            kind = data.get("resultType") if isinstance(data, dict) else None
            raise PrometheusError(f"expected an instant vector, got {kind!r}; query: {promql}")
        series = []
        try:
            for item in data["result"]:
                value = float(item["value"][1])
                series.append((dict(item["metric"]), value))
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise PrometheusError(
                f"malformed vector from Prometheus ({e!r}); query: {promql}"
            ) from None
        return series

    # -- collecting -------------------------------------------------------------

    async def _collect(self, pods: list[str]) -> dict[str, PodMetrics]:
        """Ask every configured query for ``pods``; one query per metric."""
        found = {p: PodMetrics() for p in pods}
        gpu_selector = self._selector(pods, self.pod_label, self.namespace_label)

        async def ask(template: str, selector: str, label: str) -> dict[str, list[float]]:
            if not template:
                return {}
            promql = Template(template).safe_substitute(selector=selector, pod_label=label)
            values: dict[str, list[float]] = {}
            for labels, value in await self.query(promql):
                pod = labels.get(label)
                if pod in found and not math.isnan(value):
                    values.setdefault(pod, []).append(value)
                    found[pod].seen = True
            return values

        gpu = await ask(self.gpu_query, gpu_selector, self.pod_label)
        missing = [p for p in pods if p not in gpu]
        if missing and self.gpu_fallback_query:
            selector = self._selector(missing, self.pod_label, self.namespace_label)
            gpu.update(await ask(self.gpu_fallback_query, selector, self.pod_label))
        memory = await ask(self.memory_query, gpu_selector, self.pod_label)
        count = await ask(self.gpu_count_query, gpu_selector, self.pod_label)
        cpu_selector = self._selector(pods, self.cpu_pod_label, self.cpu_namespace_label)
        cpu = await ask(self.cpu_query, cpu_selector, self.cpu_pod_label)
        for pod, metrics in found.items():
            if pod in gpu:
                metrics.gpu_percent = max(gpu[pod])
            if pod in memory:
                metrics.gpu_memory_bytes = int(sum(memory[pod]))
            if pod in count:
                metrics.gpu_count = int(sum(count[pod]))
            if pod in cpu:
                metrics.cpu_percent = sum(cpu[pod])
        return found

    async def prefetch(self, servers: Iterable[Server]) -> None:
        """Query all ``servers``' pods at once, for the :meth:`read` calls of this tick.

        Never raises: a failure is kept and reported once by the :meth:`read` of
        each of these servers, so a Prometheus outage costs one failed query, not one per server.
        """
        pods = sorted({self.pod_name(s) for s in servers})
        self._prefetched = _Prefetched()
        if not pods:
            return
        try:
            self._prefetched.pods = await self._collect(pods)
        except Exception as e:
            self._prefetched.error = f"{type(e).__name__}: {e}"
            self._prefetched.failed = set(pods)
            self.log.warning("prometheus: prefetch for %d pods failed: %s", len(pods), e)

    def _not_found(self, server: Server, pod: str) -> str:
        where = f" in namespace {self.namespace}" if self.namespace else ""
        return (
            f"no series for pod {pod}{where} ({server.key}); check PrometheusSignal.namespace, "
            "pod_name_template and pod_label against the pod's labels in Prometheus"
        )

    async def read(self, server: Server, now: float) -> Sample:
        pod = self.pod_name(server)
        prefetched = self._prefetched
        if prefetched is not None and pod in prefetched.failed:
            prefetched.failed.discard(pod)
            raise PrometheusError(prefetched.error)
        if prefetched is not None and pod in prefetched.pods:
            metrics = prefetched.pods.pop(pod)
        else:
            metrics = (await self._collect([pod]))[pod]
        if not metrics.seen:
            raise LookupError(self._not_found(server, pod))
        return metrics.sample(now)
