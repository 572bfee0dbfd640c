"""The jupyter-server extension behind the Lab panel.

It adds ``GET /gpusnap/status``, ``POST /gpusnap/keep`` and ``POST /gpusnap/suspend`` under the
single-user server's base_url. Each one calls the gpusnap service for *this* server
(``JUPYTERHUB_USER`` / ``JUPYTERHUB_SERVER_NAME``) with the server's own Hub token, so the browser
never needs a token for the service. ``GET /gpusnap/autounpark`` answers locally: whether a parked
kernel's GPU memory is being brought back right now (the panel's "resuming…"); the status
carries the same under ``autounpark``.

It also reports the server's kernels and terminals to the service (:mod:`.report`), so the
service needs no access to the server. It loads nothing GPU-related (no libcuda, no NVML)
until the service says this server is parked: only then does it start the automatic unpark,
which needs the CUDA driver (a GPU-less image, or a server never parked, never loads it).
Enable it with
``jupyter server extension enable jupyterhub_gpusnap.serverext`` (pip installs the config file that
does this).
"""

from __future__ import annotations

from tornado.ioloop import IOLoop

from .client import GpuSnapClient, service_url_from_env
from .handlers import handlers
from .report import GpuSnapReporter


def on_status(serverapp, status: dict) -> None:
    """The service's word on this server (a report's answer, a status): once it says the
    server is parked, start the automatic unpark, so that a parked kernel that runs a cell
    gets its GPU memory back by itself. Before that nothing here touches the GPU driver."""
    if status.get("state") != "parked" or serverapp.web_app.settings.get("gpusnap_autounpark"):
        return
    from ..gpu.autounpark import _load_jupyter_server_extension as start_autounpark

    start_autounpark(serverapp)


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "jupyterhub_gpusnap.serverext"}]


def _load_jupyter_server_extension(serverapp) -> None:
    """Register the handlers; called once by jupyter-server at start-up."""
    client = GpuSnapClient(parent=serverapp, log=serverapp.log)
    web_app = serverapp.web_app
    web_app.settings["gpusnap_client"] = client
    web_app.settings["gpusnap_on_status"] = lambda status: on_status(serverapp, status)
    base_url = web_app.settings.get("base_url", "/")
    web_app.add_handlers(".*$", handlers(base_url))
    reporter = GpuSnapReporter(
        serverapp,
        client,
        on_answer=web_app.settings["gpusnap_on_status"],
        parent=serverapp,
        log=serverapp.log,
    )
    web_app.settings["gpusnap_reporter"] = reporter
    IOLoop.current().add_callback(reporter.start)
    if client.server_key is None:
        serverapp.log.info(
            "gpusnap: not running under JupyterHub (JUPYTERHUB_USER is unset); the Lab panel will say so"
        )
    else:
        serverapp.log.info(
            "gpusnap: %s talks to the gpusnap service at %s", client.server_key, client.service_url
        )


__all__ = [
    "GpuSnapClient",
    "GpuSnapReporter",
    "service_url_from_env",
    "_jupyter_server_extension_points",
    "_load_jupyter_server_extension",
]
