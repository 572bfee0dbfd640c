"""The one error type of the Kubernetes side: the API server, the kubelet and the node agents."""

from __future__ import annotations


class AgentError(Exception):
    """A failure reported as ``{"error": message, "fix": fix}`` with the HTTP status ``code``.

    Raised by the API-server client, by the agent client on the hub side (the agent's own
    ``error`` and ``fix``) and inside the agent, which answers it to its caller.
    ``transient``: a failure worth another try (see
    :func:`~jupyterhub_gpusnap.kube.agent.agent_failure_is_transient`).
    """

    def __init__(self, message: str, fix: str = "", code: int = 500, transient: bool = False):
        super().__init__(message)
        self.message = message
        self.fix = fix
        self.code = code
        self.transient = transient

    def as_dict(self) -> dict:
        return {"error": self.message, "fix": self.fix}

    def __str__(self) -> str:
        return f"{self.message} (fix: {self.fix})" if self.fix else self.message
