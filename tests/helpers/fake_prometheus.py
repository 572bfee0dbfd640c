"""A wire-level stand-in for the Prometheus HTTP API's instant queries (``GET /api/v1/query``).

A real tornado server answering with Prometheus's exact JSON shapes from a dict
of series, recording every query it was asked. It evaluates the small part of
PromQL our queries use: one ``metric{matchers}`` selector (``=``, ``!=``, ``=~``,
``!~``, regexes fully anchored as in Prometheus), an optional leading
``sum|max|min|avg|count by (labels) (...)`` and an optional trailing ``* number``.
Functions such as ``rate(...[2m])`` are not evaluated: a counter's series holds
the per-second rate the query should see.
"""

from __future__ import annotations

import json
import re
import socket
import time
from dataclasses import dataclass, field

from tornado.httpserver import HTTPServer
from tornado.web import Application, RequestHandler

_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}")
_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')
_AGGREGATION = re.compile(r"^\s*(sum|max|min|avg|count)\s+by\s*\(([^)]*)\)")
_SCALE = re.compile(r"\*\s*([0-9][0-9.eE+-]*)\s*$")


@dataclass
class Series:
    labels: dict[str, str]
    value: float


@dataclass
class FakePrometheus:
    """Series by metric name; ``queries`` lists every PromQL string received, in order."""

    series: dict[str, list[Series]] = field(default_factory=dict)
    queries: list[str] = field(default_factory=list)
    # when set, every answer is this (HTTP code, body bytes) instead
    broken: tuple[int, bytes] | None = None
    port: int = 0
    _server: HTTPServer | None = None

    def add(self, metric: str, value: float, **labels: str) -> None:
        self.series.setdefault(metric, []).append(Series(labels, value))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        app = Application([(r"/api/v1/query", QueryHandler, {"fake": self})])
        self._server = HTTPServer(app)
        self._server.add_sockets([sock])

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()

    # -- the PromQL subset -------------------------------------------------------

    def evaluate(self, promql: str) -> list[dict]:
        found = _SELECTOR.search(promql)
        if not found:
            raise ValueError(f"no selector in {promql!r}")
        metric, matcher_text = found.groups()
        matchers = []
        position = 0
        while position < len(matcher_text):
            m = _MATCHER.match(matcher_text, position)
            if not m:
                raise ValueError(f"bad matchers {matcher_text!r}")
            name, op, raw = m.groups()
            value = re.sub(r"\\(.)", r"\1", raw)
            matchers.append((name, op, value))
            position = m.end()
        rows = [s for s in self.series.get(metric, []) if _matches(s.labels, matchers)]
        results = [(dict(s.labels, __name__=metric), s.value) for s in rows]
        aggregation = _AGGREGATION.match(promql)
        if aggregation:
            op, by = aggregation.groups()
            keys = [k.strip() for k in by.split(",") if k.strip()]
            groups: dict[tuple, list[float]] = {}
            for labels, value in results:
                groups.setdefault(tuple(labels.get(k, "") for k in keys), []).append(value)
            reduce = {
                "sum": sum,
                "max": max,
                "min": min,
                "avg": lambda v: sum(v) / len(v),
                "count": len,
            }[op]
            results = [
                ({k: v for k, v in zip(keys, group, strict=True) if v}, float(reduce(values)))
                for group, values in groups.items()
            ]
        scale = _SCALE.search(promql)
        if scale:
            factor = float(scale.group(1))
            results = [
                ({k: v for k, v in labels.items() if k != "__name__"}, value * factor)
                for labels, value in results
            ]
        now = time.time()
        return [{"metric": labels, "value": [now, _format(value)]} for labels, value in results]


def _format(value: float) -> str:
    if value != value:
        return "NaN"
    return repr(float(value)) if value != int(value) else str(int(value))


def _matches(labels: dict[str, str], matchers: list[tuple[str, str, str]]) -> bool:
    for name, op, value in matchers:
        have = labels.get(name, "")
        if op == "=" and have != value:
            return False
        if op == "!=" and have == value:
            return False
        if op == "=~" and not re.fullmatch(value, have):
            return False
        if op == "!~" and re.fullmatch(value, have):
            return False
    return True


class QueryHandler(RequestHandler):
    def initialize(self, fake: FakePrometheus) -> None:
        self.fake = fake

    def get(self) -> None:
        query = self.get_argument("query", "")
        self.fake.queries.append(query)
        self.set_header("Content-Type", "application/json")
        if self.fake.broken is not None:
            code, body = self.fake.broken
            self.set_status(code)
            self.finish(body)
            return
        try:
            result = self.fake.evaluate(query)
        except ValueError as e:
            self.set_status(400)
            self.finish(json.dumps({"status": "error", "errorType": "bad_data", "error": str(e)}))
            return
        self.finish(
            json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}})
        )
