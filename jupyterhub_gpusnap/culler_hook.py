"""A ``cull_arbiter_hook`` for jupyterhub-idle-culler 2.x: our signals and policy, their culler.

For hubs that keep jupyterhub-idle-culler (plain stop, no checkpoint) but want it to stop
only *truly* idle servers — no busy kernel, quiet CPU and GPU — put this in the culler's
config file (``jupyterhub-idle-culler --config-file=culler_config.py``)::

    from jupyterhub_gpusnap.culler_hook import GpuSnapArbiter
    c.IdleCuller.cull_arbiter_hook = GpuSnapArbiter(
        proxy_url="http://127.0.0.1:8000", cpu_threshold=10, gpu_threshold=5,
    )

The culler must have ``admin:server_state`` (for the server's pid) and ``access:servers``
(to read kernels) in its role, besides its usual scopes: the hook polls each server's kernels
through the proxy (:class:`JupyterPollSignal`), since the servers report theirs to the gpusnap
service only. That is the culler's trade-off to make (docs/security.md): the gpusnap service
itself needs no access to any server. The culler's own ``--timeout`` stays
the idle window; this hook adds the signals: a server the culler finds inactive is culled
only when our signals have also been quiet for that long.
"""

from __future__ import annotations

import os
import time

from .hub import servers_of
from .model import Sample, State
from .policy import Rule, ServerStatus, step
from .signals.jupyter import JupyterPollSignal
from .signals.local import LocalProcessSignal
from .signals.nvml import NvmlSignal


class GpuSnapArbiter:
    """Callable with the culler's hook signature ``(inactive, inactive_limit, server)``."""

    def __init__(
        self,
        proxy_url: str | None = None,
        api_token: str | None = None,
        cpu_threshold: float = 10.0,
        gpu_threshold: float = 5.0,
        sources=None,
        clock=time.time,
    ):
        self.proxy_url = proxy_url or os.environ.get(
            "JUPYTERHUB_PUBLIC_URL", "http://127.0.0.1:8000"
        )
        token = api_token or os.environ.get("JUPYTERHUB_API_TOKEN", "")
        self.sources = sources or [
            JupyterPollSignal(proxy_url=self.proxy_url, api_token=token),
            LocalProcessSignal(),
            NvmlSignal(),
        ]
        self.cpu_threshold = cpu_threshold
        self.gpu_threshold = gpu_threshold
        self.clock = clock
        self.statuses: dict[str, ServerStatus] = {}
        self._ready = False

    async def __call__(self, inactive, inactive_limit, server, **kwargs) -> bool:
        if not self._ready:
            for source in self.sources:
                await source.setup()
            self._ready = True
        now = self.clock()
        user = server.get("user") or {}
        name = server.get("name", "")
        # the culler passes the server model; wrap it as the user model servers_of expects
        model = {
            "name": user.get("name", "") if isinstance(user, dict) else str(user),
            "groups": user.get("groups", []) if isinstance(user, dict) else [],
            "servers": {name: {**server, "ready": True}},
        }
        if not model["name"]:
            # culler 2.x puts the owner's name in server["url"]: /user/<name>/...
            parts = (server.get("url") or "").strip("/").split("/")
            model["name"] = parts[1] if len(parts) > 1 else ""
        [srv] = servers_of(model)
        rule = Rule(
            name="idle-culler",
            idle_window=float(inactive_limit),
            warn_before=0,
            min_running=0,
            cpu_threshold=self.cpu_threshold,
            gpu_threshold=self.gpu_threshold,
            action="stop",
        )
        sample = Sample(time=now)
        for source in self.sources:
            sample.merge(await source.sample(srv, now))
        status = self.statuses.get(srv.key) or ServerStatus(
            key=srv.key,
            user=srv.user,
            name=srv.name,
            state=State.active,
            state_since=now,
            last_active=srv.started.timestamp() if srv.started else now,
            started=srv.started.timestamp() if srv.started else now,
        )
        status, decision = step(status, sample, rule, now)
        self.statuses[srv.key] = status
        culler_says = inactive is not None and inactive.total_seconds() >= inactive_limit
        return culler_says and decision.action == "stop"
