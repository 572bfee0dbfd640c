"""docs/configuration.md names every setting of the service and of the parts it loads, and no
setting that does not exist; docs/install.md shows the ones an admin meets first."""

from __future__ import annotations

import re
from pathlib import Path

from jupyterhub_gpusnap.app import GpuSnap
from jupyterhub_gpusnap.checkpoint.kubernetes import KubernetesBackend
from jupyterhub_gpusnap.checkpoint.local import LocalBackend
from jupyterhub_gpusnap.checkpoint.oci import RegistryClient
from jupyterhub_gpusnap.gpu.cuda import CudaCheckpoint
from jupyterhub_gpusnap.gpu.park import Parking
from jupyterhub_gpusnap.hub import HubClient
from jupyterhub_gpusnap.kube.agent import AgentConnection, AgentLocator
from jupyterhub_gpusnap.kube.api import KubeAPI
from jupyterhub_gpusnap.notify import Mailer, Notifier, ServiceNotifier
from jupyterhub_gpusnap.retry import Backoff
from jupyterhub_gpusnap.signals.agent import AgentSignal
from jupyterhub_gpusnap.signals.base import SignalSource
from jupyterhub_gpusnap.signals.jupyter import JupyterSignal
from jupyterhub_gpusnap.signals.local import LocalProcessSignal
from jupyterhub_gpusnap.signals.nvml import NvmlSignal
from jupyterhub_gpusnap.signals.prometheus import PrometheusSignal
from jupyterhub_gpusnap.watcher import Watcher

DOCS = Path(__file__).resolve().parent.parent / "docs"
#: the service and everything it configures (what --generate-config prints, and the rest)
CLASSES = [
    GpuSnap,
    Watcher,
    HubClient,
    LocalBackend,
    CudaCheckpoint,
    Parking,
    KubernetesBackend,
    AgentConnection,
    AgentLocator,
    KubeAPI,
    RegistryClient,
    SignalSource,
    JupyterSignal,
    NvmlSignal,
    PrometheusSignal,
    AgentSignal,
    LocalProcessSignal,
    Mailer,
    Notifier,
    ServiceNotifier,
    Backoff,
]


def settings() -> set[str]:
    return {
        f"{cls.__name__}.{name}" for cls in CLASSES for name in cls.class_own_traits(config=True)
    }


def test_the_classes_cover_what_generate_config_prints():
    assert set(GpuSnap().classes) <= set(CLASSES)


def test_every_setting_is_in_the_configuration_reference():
    text = (DOCS / "configuration.md").read_text()
    reference = set(re.findall(r"^\| `(\w+\.\w+)` \|", text, re.M))
    missing = sorted(settings() - reference)
    assert missing == [], f"settings missing from docs/configuration.md, 'Every setting': {missing}"


def test_the_docs_name_no_setting_that_does_not_exist():
    by_name = {cls.__name__: cls for cls in CLASSES}
    names = set(by_name)
    # methods named in the text (LocalBackend.apply_retention()) are not settings
    methods = {
        f"{n}.{a}"
        for n, cls in by_name.items()
        for a in dir(cls)
        if callable(getattr(cls, a, None)) and not cls.class_traits().get(a)
    }
    known = settings() | methods
    for page in ("configuration.md", "install.md", "operations.md"):
        text = (DOCS / page).read_text()
        used = {f"{c}.{a}" for c, a in re.findall(r"\b([A-Z]\w+)\.([a-z_]+)\b", text) if c in names}
        stale = sorted(used - known)
        assert stale == [], f"docs/{page} names settings the code does not have: {stale}"


def test_install_shows_min_running_and_proxy_url():
    """An admin who shrinks idle_window must meet min_running; proxy_url is how the service
    reaches servers' kernels."""
    text = (DOCS / "install.md").read_text()
    snippet = text[text.index("## 3. The service's config") :]
    assert "c.GpuSnap.min_running = 600" in snippet
    assert "c.GpuSnap.proxy_url = " in snippet
    assert GpuSnap.min_running.default_value == 600
    config = (DOCS / "configuration.md").read_text()
    assert "**`min_running` (600 s by default)**" in config
