"""Authentication and authorisation shared by the API, pages and metrics.

Who may do what (the same rules for every endpoint):
- a user sees and acts on their own servers only (a token of theirs, including the single-user
  server's own token, or a browser session through Hub OAuth);
- ``custom:gpusnap:read`` sees every server; ``custom:gpusnap:admin`` (or the Hub's own
  ``admin:servers``) acts on every server;
- anything else gets 403, an unauthenticated request 403 (API) or a login redirect (pages).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

from jupyterhub.services.auth import HubOAuth, HubOAuthenticated
from tornado import web

ADMIN_SCOPES = {"custom:gpusnap:admin", "admin:servers"}
READ_SCOPES = {"custom:gpusnap:read"} | ADMIN_SCOPES


def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


def _scope_names(model: dict) -> set[str]:
    # filtered scopes (custom:gpusnap:read!user=x) do not grant the unfiltered permission
    return {s for s in model.get("scopes", []) if "!" not in s}


class BaseHandler(HubOAuthenticated, web.RequestHandler):
    """Identifies the caller through the Hub (token or OAuth cookie)."""

    @property
    def gpusnap(self):
        return self.settings["gpusnap"]

    @property
    def hub_auth(self):
        auth = self.settings.get("hub_auth")
        if auth is None:
            # the same instance as HubOAuthCallbackHandler's: the login's PKCE verifier lives there
            auth = self.settings["hub_auth"] = HubOAuth.instance(cache_max_age=60)
        return auth

    async def prepare(self):
        # identify the caller without blocking the event loop (get_current_user is sync)
        self._hub_auth_user_cache = await self.hub_auth.get_user(self, sync=False)
        if self._hub_auth_user_cache:
            self._hub_auth_user_cache.setdefault("kind", "user")

    @property
    def hub_scopes(self):
        return None  # authorisation is ours (below), per server

    @property
    def allow_all(self):
        return True

    def is_admin(self, model: dict | None) -> bool:
        return bool(model) and bool(_scope_names(model) & ADMIN_SCOPES)

    def can_read_all(self, model: dict | None) -> bool:
        return bool(model) and bool(_scope_names(model) & READ_SCOPES)

    def owns(self, model: dict | None, user: str) -> bool:
        return bool(model) and model.get("kind", "user") == "user" and model.get("name") == user


class APIHandler(BaseHandler):
    def check_xsrf_cookie(self):
        # token-authenticated requests need no xsrf; cookie-authenticated ones are checked by HubOAuth
        if getattr(self, "_token_authenticated", False):
            return
        return super().check_xsrf_cookie()

    def get_login_url(self):
        raise web.HTTPError(403, "Authenticate with a JupyterHub token (Authorization: token …)")

    def write_error(self, status_code, **kwargs):
        reason = self._reason
        exc = kwargs.get("exc_info")
        if exc and isinstance(exc[1], web.HTTPError) and exc[1].log_message:
            reason = exc[1].log_message % exc[1].args if exc[1].args else exc[1].log_message
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"status": status_code, "message": reason}))

    def write_json(self, data, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(data))

    def json_body(self) -> dict:
        if not self.request.body:
            return {}
        try:
            body = json.loads(self.request.body)
        except ValueError as e:
            raise web.HTTPError(400, f"Request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise web.HTTPError(400, "Request body must be a JSON object")
        return body

    def require_user(self) -> dict:
        model = self.current_user
        if not model:
            raise web.HTTPError(403, "Authenticate with a JupyterHub token (Authorization: token …)")
        return model
