"""The ``jupyterhub-gpusnap`` command: the service (and ``doctor``, ``keys``, ``unpack``), which
need the Hub side of the package; a clear error where only the base package is installed.

The base package is what a notebook image needs (docs/notebook-image.md); the service's own
dependencies come with the ``hub`` extra. Without them the command says so instead of
ending in a traceback about a missing module.
"""

from __future__ import annotations

import sys

#: Modules the ``hub`` extra brings (import names).
HUB_SIDE = (
    "jupyterhub",
    "sqlalchemy",
    "aiosmtplib",
    "prometheus_client",
    "jinja2",
    "zstandard",
    "cryptography",
    "kubespawner",
    "kubernetes_asyncio",
)


def main(argv=None):
    try:
        from .app import main as run
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in HUB_SIDE:
            raise
        sys.exit(
            f"jupyterhub-gpusnap: the service needs the Hub side of the package ({e.name} is "
            "not installed here). Install it with: pip install 'jupyterhub-gpusnap[hub]' "
            "(on Kubernetes: 'jupyterhub-gpusnap[kubernetes]'). A notebook image needs only "
            "the base package: see docs/notebook-image.md."
        )
    return run(argv)


if __name__ == "__main__":
    main()
