"""The Kubernetes floor: one API-server client, one node-agent client, one error type.

:mod:`.api` (:class:`~.api.KubeAPI`) talks JSON to the API server, :mod:`.agent`
(:class:`~.agent.AgentConnection`, :class:`~.agent.AgentLocator`) finds a server's pod
and the node agent beside it and calls the agent's API, and every failure is an
:class:`~.errors.AgentError`. The checkpoint backend, the agent signal, the spawner, the
doctor and the agent itself use these; nothing here imports from above.
"""

from .errors import AgentError

__all__ = ["AgentError"]
