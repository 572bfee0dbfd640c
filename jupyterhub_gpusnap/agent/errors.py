"""The one error type of the agent: what went wrong, what to do, and the HTTP status to answer."""

from __future__ import annotations


class AgentError(Exception):
    """A failure the agent reports as ``{"error": message, "fix": fix}`` with ``code``."""

    def __init__(self, message: str, fix: str = "", code: int = 500):
        super().__init__(message)
        self.message = message
        self.fix = fix
        self.code = code

    def as_dict(self) -> dict:
        return {"error": self.message, "fix": self.fix}

    def __str__(self) -> str:
        return f"{self.message} (fix: {self.fix})" if self.fix else self.message


def need(body: dict, field: str) -> str:
    value = body.get(field)
    if not value or not isinstance(value, str):
        raise AgentError(f"missing field {field!r}", f"send {field!r} in the JSON body", 400)
    return value
