"""A hub with servers running, users holding gpusnap's reader and admin roles, and the
service watching them: what the access tests call the service as."""

from __future__ import annotations

import asyncio

from tests.helpers.gpusnap_service import GpuSnapService

SETTINGS = """
c.GpuSnap.interval = 1
c.GpuSnap.idle_window = 3600
c.GpuSnap.min_running = 3600
c.GpuSnap.warn_before = 0
c.GpuSnap.action = "stop"
"""


#: Users with gpusnap roles, and a Hub admin; they need no servers of their own.
EXTRA_HUB_CONFIG = """
c.JupyterHub.allow_named_servers = True
c.Authenticator.admin_users = {"hank"}
c.JupyterHub.load_roles.extend([
    {"name": "gpusnap-readers", "users": ["rita"], "scopes": ["custom:gpusnap:read"]},
    {"name": "gpusnap-admins", "users": ["adam"], "scopes": ["custom:gpusnap:admin"]},
])
"""


#: The servers running at the start; bob/spare is there to be suspended.
SERVERS = ("alice/", "alice/lab", "bob/", "bob/spare")


async def start_hub_and_service(hub_factory, tmp_path, servers=SERVERS, settings: str = SETTINGS):
    """A hub with ``servers`` running (spawned together), the readers/admins roles, and the service.

    Returns (hub, service) once the service lists every one of them as running.
    """
    service = GpuSnapService(tmp_path / "gpusnap", settings)
    hub = await hub_factory(service.hub_config() + EXTRA_HUB_CONFIG)
    for user in {key.partition("/")[0] for key in servers}:
        await hub.ensure_user(user)
    await asyncio.gather(*(hub.start_server(*key.split("/")) for key in servers))
    await service.start(hub)

    async def all_seen():
        code, data = await service.api("GET", "api/servers")
        return code == 200 and {s["server"] for s in data["servers"] if s["running"]} == set(
            servers
        )

    await service.wait_for(all_seen, what=f"the service to list {sorted(servers)}")
    return hub, service
