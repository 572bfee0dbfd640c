"""Authentication and authorisation shared by the API, pages and metrics.

Who may do what (the same rules for every endpoint):
- every token must carry access to this service (``access:services!service=gpusnap``, or
  ``access:services``): a token its user limited to, say, ``read:users:name`` counts as no login;
- a user sees and acts on their own servers only (a token of theirs, including the single-user
  server's own token, or a browser session through Hub OAuth);
- ``custom:gpusnap:read`` sees every server; ``custom:gpusnap:admin`` (or the Hub's own
  ``admin:servers``) acts on every server;
- anything else gets 403, an unauthenticated request 403 (API) or a login redirect (pages).

Bad input is a 400, never a 500: request bodies are at most :data:`MAX_BODY_SIZE` bytes (the
HTTP server refuses a longer one before reading it), an API request with a body and no
login is refused before its body is read, and JSON must be plain RFC 8259 JSON of bounded depth.
Every answer carries a Content-Security-Policy and X-Frame-Options (see docs/security.md).
"""

from __future__ import annotations

import json
import os

from jupyterhub.services.auth import HubOAuth, HubOAuthenticated, check_scopes
from tornado import web

from ..hubconfig import access_scope
from ..service import Service

#: The largest request body the service reads (bytes). Its bodies are small JSON objects and
#: forms; the largest, a server's Jupyter report, is a few kB.
MAX_BODY_SIZE = 1024 * 1024

#: How deep a JSON body may nest (the API's bodies are flat objects).
MAX_JSON_DEPTH = 32

#: What every answer says about where it may be shown and what it may load: the pages load
#: only their own script and style sheet, post forms only to this origin, and no other site
#: may frame them (clickjacking a "Suspend now" button).
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'self'; base-uri 'none'"
    ),
    "X-Frame-Options": "SAMEORIGIN",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}

ADMIN_SCOPES = {"custom:gpusnap:admin", "admin:servers"}
READ_SCOPES = {"custom:gpusnap:read"} | ADMIN_SCOPES


def service_access_scope(service_prefix: str) -> str:
    """The scope a token needs to reach this service: ``access:services!service=<name>``.

    The name is ``$JUPYTERHUB_SERVICE_NAME`` (the Hub sets it for a managed service), else the
    last part of the service prefix (``/services/gpusnap/`` → ``gpusnap``).
    """
    name = (
        os.environ.get("JUPYTERHUB_SERVICE_NAME") or service_prefix.rstrip("/").rsplit("/", 1)[-1]
    )
    return access_scope(name)


def _too_deep(value: object, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether parsed JSON ``value`` nests deeper than ``limit`` lists and objects."""
    todo = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            todo.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return False


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number (RFC 8259); send a finite number")


def parse_json(raw: bytes) -> object:
    """A request body as JSON; ValueError (with a message for the caller) if it is not plain JSON."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("the body is not UTF-8") from None
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        value = None
    else:
        if not _too_deep(value):
            return value
    raise ValueError(f"it nests deeper than {MAX_JSON_DEPTH} levels of lists and objects")


def _scope_names(model: dict) -> set[str]:
    # filtered scopes (custom:gpusnap:read!user=x) do not grant the unfiltered permission
    return {s for s in model.get("scopes", []) if "!" not in s}


class BaseHandler(HubOAuthenticated, web.RequestHandler):
    """Identifies the caller through the Hub (token or OAuth cookie)."""

    @property
    def gpusnap(self):
        return self.settings["gpusnap"]

    @property
    def service(self) -> Service:
        """What handlers may ask of the service (never the watcher itself)."""
        return self.gpusnap.service

    @property
    def hub_auth(self):
        auth = self.settings.get("hub_auth")
        if auth is None:
            # the same instance as HubOAuthCallbackHandler's: the login's PKCE verifier lives there
            auth = self.settings["hub_auth"] = HubOAuth.instance(cache_max_age=60)
        return auth

    def set_default_headers(self) -> None:
        for name, value in SECURITY_HEADERS.items():
            self.set_header(name, value)

    @property
    def access_scope(self) -> str:
        return service_access_scope(self.gpusnap.service_prefix)

    async def prepare(self):
        # identify the caller without blocking the event loop (get_current_user is sync)
        model = await self.hub_auth.get_user(self, sync=False)
        self._refused = None
        if model:
            model.setdefault("kind", "user")
            if not check_scopes({self.access_scope}, set(model.get("scopes", []))):
                # a token without access to this service is no login here, however it was made
                self._refused = f"the token of {model['kind']} {model.get('name')} lacks the {self.access_scope} scope"
                model = None
        self._hub_auth_user_cache = model

    @property
    def hub_scopes(self):
        # checked in prepare() (HubOAuthenticated's own check is bypassed by its user cache)
        return {self.access_scope}

    @property
    def allow_all(self):
        return False

    def is_admin(self, model: dict | None) -> bool:
        return bool(model) and bool(_scope_names(model) & ADMIN_SCOPES)

    def can_read_all(self, model: dict | None) -> bool:
        return bool(model) and bool(_scope_names(model) & READ_SCOPES)

    def owns(self, model: dict | None, user: str) -> bool:
        return bool(model) and model.get("kind", "user") == "user" and model.get("name") == user

    def is_server_token(self, model: dict | None, user: str, name: str) -> bool:
        """Whether ``model`` is the token of ``user``'s server ``name``: the Hub gives a
        server's token ``access:servers!server=<user>/<name>`` (JupyterHub's ``server``
        role, or Spawner.server_token_scopes), which no other user's token can hold; the
        owner's own broader tokens (``access:servers!user=…``) do not count."""
        return self.owns(model, user) and f"access:servers!server={user}/{name}" in model.get(
            "scopes", []
        )


@web.stream_request_body
class APIHandler(BaseHandler):
    """JSON API: bodies are streamed, so that a request without a login is refused before
    its body is read (HTTPServer's max_body_size bounds the rest)."""

    async def prepare(self):
        self._chunks: list[bytes] = []
        await super().prepare()
        has_body = self.request.headers.get("Content-Length", "0") not in ("", "0") or (
            "Transfer-Encoding" in self.request.headers
        )
        if has_body and not self.current_user:
            raise web.HTTPError(403, self._login_message())

    def data_received(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        if len(self._chunks) > 1:
            self._chunks = [b"".join(self._chunks)]
        self.request.body = self._chunks[0]

    def _login_message(self) -> str:
        why = f" ({self._refused})" if getattr(self, "_refused", None) else ""
        return (
            f"Authenticate with a JupyterHub token (Authorization: token …) that has the "
            f"{self.access_scope} scope{why}"
        )

    def check_xsrf_cookie(self):
        # token-authenticated requests need no xsrf; cookie-authenticated ones are checked by HubOAuth
        if getattr(self, "_token_authenticated", False):
            return
        return super().check_xsrf_cookie()

    def get_login_url(self):
        raise web.HTTPError(403, self._login_message())

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
            body = parse_json(self.request.body)
        except (ValueError, RecursionError) as e:
            raise web.HTTPError(400, f"Request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise web.HTTPError(400, "Request body must be a JSON object")
        return body

    def require_user(self) -> dict:
        model = self.current_user
        if not model:
            raise web.HTTPError(403, self._login_message())
        return model
