"""The service's web app: REST API, pages and /metrics."""

from __future__ import annotations

from jupyterhub.services.auth import HubOAuthCallbackHandler

from .api import (
    EventsHandler,
    InfoHandler,
    MakeRoomHandler,
    ServerActionHandler,
    ServerHandler,
    ServersHandler,
)
from .metrics import MetricsHandler

SERVER = r"(?P<user>[^/]+)(?:/(?P<name>[^/]*))?"


def make_handlers(prefix: str) -> list:
    """URL routes under the service prefix (e.g. /services/gpusnap/)."""
    routes = [
        (prefix + r"api/info", InfoHandler),
        (prefix + r"api/servers", ServersHandler),
        (
            prefix
            + r"api/servers/"
            + SERVER
            + r"/(?P<action>keep|suspend|exempt|interaction|jupyter)",
            ServerActionHandler,
        ),
        (prefix + r"api/servers/" + SERVER, ServerHandler),
        (prefix + r"api/events", EventsHandler),
        (prefix + r"api/make-room", MakeRoomHandler),
        (prefix + r"metrics", MetricsHandler),
        (prefix + r"oauth_callback", HubOAuthCallbackHandler),
    ]
    try:
        from .pages import page_handlers
    except ImportError:  # pages are optional to the API
        return routes
    return routes + page_handlers(prefix)
