"""What a jupyterhub_config.py needs from us: the service's role, our custom scopes, our templates.

    from jupyterhub_gpusnap.hubconfig import CUSTOM_SCOPES, TEMPLATE_PATH, service_role
    c.JupyterHub.custom_scopes = CUSTOM_SCOPES
    c.JupyterHub.load_roles = [service_role("gpusnap"), ...]
    c.JupyterHub.template_paths = [TEMPLATE_PATH]
"""

from __future__ import annotations

import os

#: The Hub scopes the service needs, and why (docs/install.md shows them as a load_roles entry).
REQUIRED_SCOPES = {
    "list:users": "list users with running servers (GET /users?state=ready)",
    "read:users": "read user names and groups (for per-group rules)",
    "read:users:activity": "read last_activity",
    "read:servers": "read each server's url, start time and readiness",
    "admin:server_state": "read the spawner state (the server's pid on local spawners)",
    "access:servers": "poll /api/kernels through the proxy (with no_track_activity=1)",
    "delete:servers": "stop a server after its checkpoint is verified",
}

#: Only when emails take the address from auth_state (Notifier.address_from = "auth_state").
AUTH_STATE_SCOPE = "admin:auth_state"

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


def service_role(service: str = "gpusnap", email_from_auth_state: bool = False) -> dict:
    """The load_roles entry for the service: the minimum scopes it needs."""
    scopes = sorted(REQUIRED_SCOPES)
    if email_from_auth_state:
        scopes.append(AUTH_STATE_SCOPE)
    return {"name": f"{service}-service", "services": [service], "scopes": scopes}
