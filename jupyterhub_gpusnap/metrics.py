"""Prometheus metrics of the service (served at /services/<name>/metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .model import State

REGISTRY = CollectorRegistry(auto_describe=True)

SERVERS = Gauge(
    "gpusnap_servers", "Servers known to the service, per state.", ["state"], registry=REGISTRY
)
SIGNAL = Gauge(
    "gpusnap_signal",
    "Latest value of each signal per server (cpu and gpu in percent, gpu_memory in bytes, kernels_busy).",
    ["server", "signal"],
    registry=REGISTRY,
)
IDLE_SECONDS = Gauge(
    "gpusnap_idle_seconds",
    "Seconds each server has been idle by every signal.",
    ["server"],
    registry=REGISTRY,
)
ACTIONS = Counter(
    "gpusnap_actions",
    "Actions taken on servers (warn, park, unpark, suspend, stop, restore), by result (ok, refused, failed).",
    ["action", "result"],
    registry=REGISTRY,
)
FAILURES = Counter(
    "gpusnap_failures",
    "Failures by kind (signal, suspend, restore, email, hub).",
    ["kind"],
    registry=REGISTRY,
)
LOOP_SECONDS = Histogram(
    "gpusnap_loop_duration_seconds",
    "Wall time of one service tick (listing servers, reading signals, applying the policy).",
    registry=REGISTRY,
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)
ACTION_SECONDS = Histogram(
    "gpusnap_action_duration_seconds",
    "Wall time of suspend, restore, park and unpark.",
    ["action"],
    registry=REGISTRY,
    buckets=(0.1, 0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320),
)
GPU_SECONDS_FREED = Counter(
    "gpusnap_gpu_seconds_freed",
    "GPU-seconds given back to the pool by suspensions (GPUs held x time suspended), counted at restore.",
    registry=REGISTRY,
)

MAKE_ROOM = Counter(
    "gpusnap_make_room",
    "Make-room runs (parking idle servers until GPU memory is free), by trigger (api: the admin "
    "API; min_free_gpu_memory: a GPU had less free than Watcher.min_free_gpu_memory) and result "
    "(enough, short: the idle servers held too little).",
    ["trigger", "result"],
    registry=REGISTRY,
)
MAKE_ROOM_BYTES = Counter(
    "gpusnap_make_room_bytes",
    "GPU memory moved to host RAM by make-room parks, by trigger (api, min_free_gpu_memory).",
    ["trigger"],
    registry=REGISTRY,
)
GPU_FREE_BYTES = Gauge(
    "gpusnap_gpu_free_bytes",
    "Free memory of each GPU when Watcher.min_free_gpu_memory was last checked, by node (the "
    "Kubernetes node name; empty for the GPUs of the service's own machine) and gpu (its index there).",
    ["node", "gpu"],
    registry=REGISTRY,
)


def set_state_counts(counts: dict[str, int]) -> None:
    for state in State:
        SERVERS.labels(state=state.value).set(counts.get(state.value, 0))


def forget_server(key: str) -> None:
    for signal in ("cpu", "gpu", "gpu_memory", "kernels_busy"):
        try:
            SIGNAL.remove(key, signal)
        except KeyError:
            pass
    try:
        IDLE_SECONDS.remove(key)
    except KeyError:
        pass
