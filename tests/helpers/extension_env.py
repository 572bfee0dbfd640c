"""The server extension and the Lab extension, installed for a single-user server as
``pip install`` puts them under sys.prefix, and the service's address in its environment."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.helpers.gpusnap_service import GpuSnapService

PACKAGE = Path(__file__).resolve().parent.parent.parent / "jupyterhub_gpusnap"


def jupyter_paths(root: Path) -> dict:
    """JUPYTER_CONFIG_PATH / JUPYTER_PATH holding what `pip install` puts under sys.prefix:
    the config file that enables the server extension, and the built Lab extension."""
    config = root / "etc"
    (config / "jupyter_server_config.d").mkdir(parents=True, exist_ok=True)
    shutil.copy(
        PACKAGE / "serverext" / "etc" / "jupyterhub_gpusnap.json",
        config / "jupyter_server_config.d" / "jupyterhub_gpusnap.json",
    )
    data = root / "share"
    (data / "labextensions").mkdir(parents=True, exist_ok=True)
    link = data / "labextensions" / "jupyterhub-gpusnap"
    if not link.exists():
        link.symlink_to(PACKAGE / "labextension", target_is_directory=True)
    return {"JUPYTER_CONFIG_PATH": str(config), "JUPYTER_PATH": str(data)}


def spawner_environment(service: GpuSnapService, root: Path, **extra: str) -> str:
    """c.Spawner.environment: the extension's files, and where the service is."""
    env = jupyter_paths(root)
    env.update(extra)
    env["GPUSNAP_SERVICE_URL"] = f"http://127.0.0.1:{service.port}/services/gpusnap/"
    return f"c.Spawner.environment = {env!r}\n"
