"""The ``agent`` signal: per-pod CPU (cgroup v2) and GPU (NVML) activity from the node agents.

For each server the pod is found (KubeSpawner state, else the pod name template),
then its node and the agent on that node; ``GET /v1/signals?pod=NS/POD`` answers
``cpu_percent``, ``gpu_percent``, ``gpu_memory_bytes`` and ``gpu_count``. Where the
pod lives is cached for ``placement_cache_seconds``: pods do not move while they run.
"""

from __future__ import annotations

import time
from urllib.parse import urlencode

from traitlets import Float, Instance, default

from ..kube.agent import AgentLocator
from ..kube.errors import AgentError
from ..model import Sample, Server
from .base import SignalSource


class AgentSignal(SignalSource):
    """Reads a server's CPU and GPU use from the gpusnap agent on its node."""

    name = "agent"

    placement_cache_seconds = Float(
        300.0,
        help="Seconds to remember which node (and agent) a server's pod runs on before asking the "
        "API server again. A pod that is recreated is looked up again at once on an error.",
    ).tag(config=True)

    locator = Instance(AgentLocator)

    @default("locator")
    def _locator(self) -> AgentLocator:
        return AgentLocator(parent=self)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._placement: dict[str, tuple[str, float]] = {}

    async def _agent_for(self, namespace: str, pod: str) -> str:
        key = f"{namespace}/{pod}"
        cached = self._placement.get(key)
        if cached and cached[1] > time.monotonic():
            return cached[0]
        node = await self.locator.node_of(namespace, pod)
        base = await self.locator.agent_url(node)
        self._placement[key] = (base, time.monotonic() + self.placement_cache_seconds)
        return base

    async def read(self, server: Server, now: float) -> Sample:
        namespace, pod = self.locator.pod_of(server)
        key = f"{namespace}/{pod}"
        try:
            base = await self._agent_for(namespace, pod)
            data = await self.locator.call(
                base, "GET", "/v1/signals?" + urlencode({"pod": key}), timeout=self.timeout
            )
        except AgentError as e:
            self._placement.pop(key, None)
            return Sample(time=now, errors={self.name: str(e)})
        entry = (data.get("pods") or {}).get(key) or {}
        sample = Sample(
            time=now,
            cpu_percent=entry.get("cpu_percent"),
            gpu_percent=entry.get("gpu_percent"),
            gpu_memory_bytes=entry.get("gpu_memory_bytes"),
            gpu_count=entry.get("gpu_count"),
        )
        if entry.get("error"):
            self._placement.pop(key, None)
            sample.errors[self.name] = entry["error"]
        return sample
