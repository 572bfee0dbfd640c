"""A server's status and a sample in which nothing happens, for tests of the policy."""

from __future__ import annotations

from jupyterhub_gpusnap.model import Sample, State
from jupyterhub_gpusnap.policy import ServerStatus

T0 = 1_800_000_000.0  # the server started here


def status(**kw) -> ServerStatus:
    base = dict(key="alice/", user="alice", state=State.idle, state_since=T0, last_active=T0)
    base.update(started=T0)
    base.update(kw)
    return ServerStatus(**base)


def quiet(t: float, **kw) -> Sample:
    """A sample where every signal says "nothing happening"."""
    base = dict(kernels=1, kernels_busy=0, terminals=0, jupyter_last_activity=T0 - 10)
    base.update(cpu_percent=0.5, gpu_percent=0.0, gpu_memory_bytes=0)
    base.update(kw)
    return Sample(time=t, **base)
