"""What a jupyterhub_config.py needs from us: the service's role, the users' and servers' access
to it, our custom scopes, our templates.

    from jupyterhub_gpusnap.hubconfig import (
        CUSTOM_SCOPES, TEMPLATE_PATH, server_token_scopes, service_role, user_role,
    )
    c.JupyterHub.custom_scopes = CUSTOM_SCOPES
    c.JupyterHub.load_roles = [service_role("gpusnap"), user_role("gpusnap"), ...]
    c.Spawner.server_token_scopes = server_token_scopes("gpusnap")
    c.JupyterHub.template_paths = [TEMPLATE_PATH]
"""

from __future__ import annotations

import os

#: The Hub scopes the service needs, and why (docs/install.md shows them as a load_roles entry).
#: No access:servers: the service never talks to a single-user server; the servers' own
#: extension reports their kernels and terminals to it (signals/jupyter.py).
REQUIRED_SCOPES = {
    "list:users": "list users with running servers (GET /users?state=ready)",
    "read:users": "read user names and groups (for per-group rules)",
    "read:users:activity": "read last_activity",
    "read:servers": "read each server's url, start time and readiness",
    "admin:server_state": "read the spawner state (the server's pid on local spawners)",
    "delete:servers": "stop a server after its checkpoint is verified",
}

#: Only when emails take the address from auth_state (Notifier.address_from = "auth_state").
AUTH_STATE_SCOPE = "admin:auth_state"

#: Only when the admin opts into polling servers that do not report (JupyterPollSignal in GpuSnap.signal_classes):
#: it lets the service's token read every running server's files and run code in it.
JUPYTER_POLL_SCOPE = "access:servers"

#: JupyterHub's default scopes of a server's own token (the ``server`` role).
HUB_SERVER_TOKEN_SCOPES = ["users:activity!user", "access:servers!server"]

CUSTOM_SCOPES = {
    "custom:gpusnap:read": {
        "description": "See every server's gpusnap state, signals and snapshots.",
    },
    "custom:gpusnap:admin": {
        "description": "Suspend, keep running or exempt any server through gpusnap.",
        "subscopes": ["custom:gpusnap:read"],
    },
}

TEMPLATE_PATH = os.path.join(os.path.dirname(__file__), "templates", "hub")


def access_scope(service: str = "gpusnap") -> str:
    """The scope a token needs to reach the service at all."""
    return f"access:services!service={service}"


def service_role(
    service: str = "gpusnap", email_from_auth_state: bool = False, jupyter_poll: bool = False
) -> dict:
    """The load_roles entry for the service: the minimum scopes it needs.

    ``jupyter_poll``: add ``access:servers``, for ``JupyterPollSignal`` only.
    """
    scopes = sorted(REQUIRED_SCOPES)
    if email_from_auth_state:
        scopes.append(AUTH_STATE_SCOPE)
    if jupyter_poll:
        scopes.append(JUPYTER_POLL_SCOPE)
    return {"name": f"{service}-service", "services": [service], "scopes": scopes}


def user_role(service: str = "gpusnap") -> dict:
    """The load_roles entry for the ``user`` role: JupyterHub's ``self`` plus access to the
    service (its pages, the Lab panel, and what their servers' tokens may be given)."""
    return {"name": "user", "scopes": ["self", access_scope(service)]}


def server_token_scopes(service: str = "gpusnap") -> list[str]:
    """``c.Spawner.server_token_scopes``: JupyterHub's default for a server's token plus access
    to the service, so that the server's extension can report its kernels and the Lab panel
    reach the service. The Hub grants a server's token only what its user holds, so users need
    the same access (:func:`user_role`)."""
    return [*HUB_SERVER_TOKEN_SCOPES, access_scope(service)]
