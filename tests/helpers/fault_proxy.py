"""A small HTTP proxy that passes requests to a real server and breaks the ones a test names.

It stands where a load balancer or an ingress controller stands in production, in front
of the real registry (or another server): every request is forwarded as it came (method,
headers including ``Host``, body) and the real answer returned, except those matching a
:class:`Fault`, which get a 502 (or another status) instead:

- ``when="before"``: the request never reaches the server (a gateway that could not
  connect);
- ``when="after"``: the server handles it, its answer is lost (a gateway that timed out
  reading it).

``requests`` records ``(method, path, body bytes, status answered)``; ``forwarded`` the
same for what reached the server.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.httpserver import HTTPServer

from .ports import free_port

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}


@dataclass
class Fault:
    """Answer ``status`` to the ``nth`` (1-based) to ``nth + times - 1``-th requests with
    ``method`` whose path matches ``path`` (``times=0``: every one from the ``nth`` on)."""

    method: str
    path: str = ".*"
    nth: int = 1
    times: int = 1
    when: str = "before"
    status: int = 502
    seen: int = 0
    hits: int = 0

    def matches(self, method: str, path: str) -> bool:
        if method != self.method or not re.search(self.path, path):
            return False
        self.seen += 1
        if self.seen < self.nth or (self.times and self.seen >= self.nth + self.times):
            return False
        self.hits += 1
        return True


@dataclass
class FaultProxy:
    upstream: str  # http://host:port of the real server
    faults: list[Fault] = field(default_factory=list)
    requests: list[tuple[str, str, int, int]] = field(default_factory=list)
    forwarded: list[tuple[str, str, int, int]] = field(default_factory=list)

    def __post_init__(self):
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.host}"
        self.server: HTTPServer | None = None
        self._client = AsyncHTTPClient(force_instance=True, max_body_size=1 << 40)

    def sent(self, method: str, path: str = ".*") -> int:
        """Body bytes of ``method`` requests on ``path`` that reached the server."""
        return sum(n for m, p, n, _ in self.forwarded if m == method and re.search(path, p))

    def count(self, method: str, path: str = ".*") -> int:
        return sum(1 for m, p, _, _ in self.requests if m == method and re.search(path, p))

    async def start(self) -> FaultProxy:
        proxy = self

        class Forward(web.RequestHandler):
            SUPPORTED_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")

            async def handle(self) -> None:
                req = self.request
                fault = next((f for f in proxy.faults if f.matches(req.method, req.path)), None)
                body = req.body if req.method in ("POST", "PUT", "PATCH") else None
                if fault is None or fault.when == "after":
                    headers = {
                        k: v for k, v in req.headers.get_all() if k.lower() not in HOP_BY_HOP
                    }
                    answer = await proxy._client.fetch(
                        HTTPRequest(
                            proxy.upstream + req.uri,
                            method=req.method,
                            headers=headers,
                            body=body,
                            follow_redirects=False,
                            decompress_response=False,
                            allow_nonstandard_methods=True,
                            request_timeout=120,
                        ),
                        raise_error=False,
                    )
                    proxy.forwarded.append(
                        (req.method, req.path, len(req.body or b""), answer.code)
                    )
                if fault is not None:
                    proxy.requests.append(
                        (req.method, req.path, len(req.body or b""), fault.status)
                    )
                    self.set_status(fault.status)
                    self.set_header("Content-Type", "text/html")
                    self.finish(f"<html><body>{fault.status} Bad Gateway</body></html>")
                    return
                proxy.requests.append((req.method, req.path, len(req.body or b""), answer.code))
                self.set_status(answer.code, answer.reason)
                copied: set[str] = set()
                for k, v in answer.headers.get_all():
                    if k.lower() in HOP_BY_HOP | {"content-length"}:
                        continue
                    (self.add_header if k.lower() in copied else self.set_header)(k, v)
                    copied.add(k.lower())
                if req.method != "HEAD" and answer.body:
                    self.write(answer.body)
                elif req.method == "HEAD" and "Content-Length" in answer.headers:
                    self.set_header("Content-Length", answer.headers["Content-Length"])
                self.finish()

            get = head = post = put = patch = delete = handle

        self.server = HTTPServer(
            web.Application([(r".*", Forward)]), max_body_size=1 << 40, max_buffer_size=1 << 30
        )
        self.server.listen(self.port, "127.0.0.1")
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            await self.server.close_all_connections()
        self._client.close()
