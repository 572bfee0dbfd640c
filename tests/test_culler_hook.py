"""jupyterhub-idle-culler 2.x with our cull_arbiter_hook: it stops only truly idle servers.

A real hub, real single-user servers, and the culler's own ``cull_idle`` coroutine: both
servers look inactive to the culler (Hub activity), but bob's kernel is running a silent
cell, so our signals keep his server.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from jupyterhub_idle_culler import cull_idle

from jupyterhub_gpusnap.culler_hook import GpuSnapArbiter
from tests.helpers.browser_tab import open_tab, send_execute

pytestmark = pytest.mark.e2e


async def test_culler_with_our_arbiter_culls_only_the_idle_server(hub):
    await hub.start_server("alice")
    await hub.start_server("bob")
    bob_kernel, _ = await hub.execute("bob", "import time")
    ws = await open_tab(hub, "bob", bob_kernel)
    await send_execute(ws, "time.sleep(600)")
    await asyncio.sleep(3)  # both servers have now been "inactive" for longer than the limit

    arbiter = GpuSnapArbiter(proxy_url=hub.url.rstrip("/"), api_token=hub.admin_token)
    decisions = {}

    async def recording_arbiter(inactive, inactive_limit, server, **kw):
        verdict = await arbiter(inactive=inactive, inactive_limit=inactive_limit, server=server)
        decisions[server["url"]] = verdict
        return verdict

    await cull_idle(
        url=hub.api_url,
        api_token=hub.admin_token,
        inactive_limit=1,
        logger=logging.getLogger("culler"),
        cull_arbiter=recording_arbiter,
    )
    assert decisions == {"/user/alice/": True, "/user/bob/": False}, decisions
    assert await hub.get_server("alice") is None
    assert await hub.get_server("bob") is not None
    ws.close()
