"""Reading the agent's request bodies; a bad one is a 400 :class:`AgentError`."""

from __future__ import annotations

from ..kube.errors import AgentError


def need(body: dict, field: str) -> str:
    value = body.get(field)
    if not value or not isinstance(value, str):
        raise AgentError(f"missing field {field!r}", f"send {field!r} in the JSON body", 400)
    return value
