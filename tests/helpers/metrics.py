"""Read the service's Prometheus metrics in a test."""

from __future__ import annotations

from jupyterhub_gpusnap import metrics


def metric(name, **labels):
    return metrics.REGISTRY.get_sample_value(name, labels) or 0
