"""Run code in a kernel of a plain jupyter server over its websocket (no hub, no proxy)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from datetime import datetime, timezone

from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.websocket import websocket_connect


def execute_request(
    code: str, *, session: str = "", username: str = "", store_history: bool = True
) -> tuple[str, str]:
    """A Jupyter ``execute_request`` for ``code`` on the shell channel: (its msg_id, the
    message as JSON text, as a kernel websocket takes it)."""
    msg_id = uuid.uuid4().hex
    message = {
        "header": {
            "msg_id": msg_id,
            "username": username,
            "session": session or uuid.uuid4().hex,
            "msg_type": "execute_request",
            "version": "5.3",
            "date": datetime.now(timezone.utc).isoformat(),
        },
        "parent_header": {},
        "metadata": {},
        "channel": "shell",
        "content": {
            "code": code,
            "silent": False,
            "store_history": store_history,
            "user_expressions": {},
            "allow_stdin": False,
            "stop_on_error": True,
        },
        "buffers": [],
    }
    return msg_id, json.dumps(message)


async def new_kernel(base: str, token: str) -> str:
    resp = await AsyncHTTPClient().fetch(
        HTTPRequest(
            f"{base}api/kernels",
            method="POST",
            body="{}",
            headers={"Authorization": f"token {token}"},
        )
    )
    return json.loads(resp.body)["id"]


async def execute(
    base: str, token: str, kernel: str, code: str, timeout: float = 300
) -> tuple[str, float]:
    """Run ``code``; return (output text, seconds from sending to the first output)."""
    ws_url = base.replace("http://", "ws://", 1) + f"api/kernels/{kernel}/channels"
    conn = await websocket_connect(HTTPRequest(ws_url, headers={"Authorization": f"token {token}"}))
    msg_id, message = execute_request(code, store_history=False)
    conn.write_message(message)
    sent = time.perf_counter()
    first = None
    out = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            raw = await asyncio.wait_for(conn.read_message(), deadline - time.monotonic())
            if raw is None:
                break
            msg = json.loads(raw)
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                first = first or time.perf_counter()
                out.append(content["text"])
            elif kind == "error":
                out.append(f"{content['ename']}: {content['evalue']}")
            elif kind == "status" and content["execution_state"] == "idle":
                break
    finally:
        conn.close()
    return "".join(out), (first or time.perf_counter()) - sent
