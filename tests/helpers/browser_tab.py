"""What a browser tab does to a kernel through the Hub's proxy: a kernel websocket kept
open, a cell submitted without waiting for it."""

from __future__ import annotations

import uuid

from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from .kernel_ws import execute_request


async def open_tab(hub, user: str, kernel_id: str):
    """What a forgotten browser tab does: a kernel websocket kept open, pinging every 0.5 s."""
    token = await hub._default_user_token(user)
    url = hub.server_url(user).replace("http://", "ws://", 1)
    url += f"api/kernels/{kernel_id}/channels?session_id={uuid.uuid4().hex}"
    return await websocket_connect(
        HTTPRequest(url, headers={"Authorization": f"token {token}"}), ping_interval=0.5
    )


async def send_execute(ws, code: str) -> None:
    """Submit a cell without waiting for it (a long silent cell)."""
    ws.write_message(execute_request(code)[1])
