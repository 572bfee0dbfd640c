"""GET /metrics in Prometheus text format (needs custom:gpusnap:read unless metrics_require_auth is off)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from tornado import web

from ..metrics import REGISTRY
from .base import APIHandler


class MetricsHandler(APIHandler):
    async def get(self):
        if self.gpusnap.metrics_require_auth:
            model = self.require_user()
            if not self.can_read_all(model):
                raise web.HTTPError(403, "Reading metrics needs the custom:gpusnap:read scope")
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(generate_latest(REGISTRY))
