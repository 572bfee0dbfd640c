"""Property-based fuzzing of the REST API against docs/rest-api.yml, on a real hub and service.

Schemathesis generates requests for every operation in the OpenAPI description (valid ones, then
invalid ones) and sends them through the proxy with a gpusnap admin's token and with a plain user's
token. Every answer must be documented (status, content type, body schema), none may be a 5xx, and
a plain user's answers never name another user unless the request itself did. Bounded: a few
examples per operation, derandomized, no shrinking, so the run takes well under a minute.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.helpers.access_hub import start_hub_and_service

pytestmark = pytest.mark.e2e

SPEC = Path(__file__).parent.parent / "docs" / "rest-api.yml"
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
MODES = {
    schemathesis.GenerationMode.POSITIVE: 8,  # examples per operation
    schemathesis.GenerationMode.NEGATIVE: 4,
}


def fuzz(
    base_url: str, token: str, private_to: str | None, others: list[str]
) -> tuple[dict, list[str]]:
    """Run every operation's strategy with ``token``; return (requests sent per mode, problems found).

    ``private_to``: the only user whose data the token may see (None for a reader or admin);
    ``others``: the other users' names, which must not appear in its answers.
    """
    schema = schemathesis.openapi.from_path(SPEC)
    headers = {"Authorization": f"token {token}"}
    sent = {mode.value: 0 for mode in MODES}
    problems: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode, examples in MODES.items():
            strategy = operation.as_strategy(generation_mode=mode, headers=headers)

            @settings(
                max_examples=examples,
                derandomize=True,
                database=None,
                deadline=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=strategy)
            def run(case):

                response = case.call(base_url=base_url, headers=headers, timeout=30)
                sent[mode.value] += 1  # noqa: B023  (run() is called within this iteration)
                case.validate_response(response, checks=CHECKS, headers=headers)
                if private_to is None:
                    return
                asked = (response.request.url or "") + str(response.request.body or "")
                for name in others:
                    if name in response.text and name not in asked:
                        raise AssertionError(
                            f"{case.method} {response.request.url} as {private_to}: "
                            f"the answer names {name}: {response.text[:300]}"
                        )

            try:
                run()
            except Unsatisfiable:
                # nothing in this operation can be made invalid (no body, no constrained parameter)
                assert mode == schemathesis.GenerationMode.NEGATIVE, operation.label
            except (Exception, FailureGroup) as e:  # every operation's failure, not only the first
                problems.append(
                    f"{operation.label} ({mode.value}): {type(e).__name__}: {str(e)[:1500]}"
                )
    return sent, problems


async def test_api_conforms_to_its_description(hub_factory, tmp_path):
    hub, service = await start_hub_and_service(hub_factory, tmp_path, servers=("alice/", "bob/"))
    try:
        admin = await hub.user_token("adam")
        alice = await hub.user_token("alice")
        base_url = f"{hub.url}services/gpusnap"
        # the fuzzing client is synchronous (requests): run it off the event loop
        sent_admin, problems = await asyncio.to_thread(fuzz, base_url, admin, None, [])
        sent_user, user_problems = await asyncio.to_thread(fuzz, base_url, alice, "alice", ["bob"])
        problems += user_problems
        assert not problems, "\n\n".join(problems)
        for sent in (sent_admin, sent_user):
            assert sent["positive"] > 50 and sent["negative"] > 10, sent
        # the service stayed healthy throughout and still answers a plain request
        code, data = await service.api("GET", "api/info", token=alice)
        assert code == 200 and data["user"] == "alice", data
        assert "Traceback" not in service.log_text(), service.log_text()[-3000:]
    finally:
        await service.stop()


def test_openapi_operations_are_all_fuzzed():
    """The fuzzer sees every operation the description has (so none is silently left out)."""
    schema = schemathesis.openapi.from_path(SPEC)
    labels = {result.ok().label for result in schema.get_all_operations()}
    assert labels == {
        "GET /api/info",
        "GET /api/servers",
        "GET /api/servers/{user}",
        "GET /api/servers/{user}/{name}",
        "POST /api/servers/{user}/keep",
        "POST /api/servers/{user}/{name}/keep",
        "POST /api/servers/{user}/suspend",
        "POST /api/servers/{user}/{name}/suspend",
        "POST /api/servers/{user}/interaction",
        "POST /api/servers/{user}/{name}/interaction",
        "POST /api/servers/{user}/jupyter",
        "POST /api/servers/{user}/{name}/jupyter",
        "POST /api/servers/{user}/exempt",
        "POST /api/servers/{user}/{name}/exempt",
        "GET /api/events",
        "POST /api/make-room",
        "GET /metrics",
    }, labels


async def raw_exchange(port: int, head: bytes, body: bytes = b"", timeout: float = 30) -> bytes:
    """Send ``head`` (request line and headers) and ``body`` to 127.0.0.1:``port``; return what
    comes back before the server closes the connection or ``timeout`` passes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        await writer.drain()
        try:
            return await asyncio.wait_for(reader.read(65536), timeout)
        except asyncio.TimeoutError:
            return b""
    finally:
        writer.close()


async def test_bad_input_is_a_400_that_says_why_never_a_500(hub_factory, tmp_path):
    hub, service = await start_hub_and_service(hub_factory, tmp_path, servers=("alice/",))
    try:
        alice = await hub.user_token("alice")
        keep = "api/servers/alice/keep"
        cases = [
            (b'{"seconds": ' + b"9" * 400 + b"}", "seconds"),
            (b'{"until": ' + b"9" * 400 + b"}", "until"),
            (b'{"until": -1e308}', "past"),
            (b'{"until": 1e308}', "9999"),
            (b'{"until": "0001-01-01T00:00:00Z"}', "past"),
            (b'{"until": "2026-11-22T18:00:00"}', "time zone"),
            (b'{"seconds": 1e308}', "seconds"),
            (b'{"seconds": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nests deeper"),
            (b"[" * 5000 + b"]" * 5000, "nests deeper"),
            (b'{"seconds": -Infinity}', "-Infinity"),
            (b'{"until": NaN}', "NaN"),
            (b'{"seconds": "\xff"}', "UTF-8"),
        ]
        for raw, word in cases:
            code, data = await service.api("POST", keep, raw, token=alice)
            assert code == 400, f"{raw[:60]!r}: {code} {data}"
            assert word in data["message"], f"{raw[:60]!r}: {data}"
            if word == "-Infinity":
                assert "NaN" not in data["message"], data
        # the same through the server's report
        code, data = await service.api(
            "POST", "api/servers/alice/jupyter", b'{"kernels": [' * 3000, token=alice
        )
        assert code in (400, 403), data
        # ?limit= is 1..500: no way around the cap
        for limit in ("-1", "0", "501", "1e3", "x"):
            code, data = await service.api(
                "GET", f"api/events?server=alice/&limit={limit}", token=alice
            )
            assert code == 400 and "limit" in data["message"], (limit, code, data)
        code, data = await service.api("GET", "api/events?server=alice/&limit=500", token=alice)
        assert code == 200, data
        # nothing above changed alice's state: still no keep-running
        assert (await service.server_status("alice/"))["keep_until"] is None

        # an anonymous 90 MB body is refused before it is read: the 403 comes back although
        # not one byte of the body was sent
        head = (
            f"POST /services/gpusnap/{keep} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {90 * 1024 * 1024}\r\n\r\n"
        ).encode()
        answer = await raw_exchange(service.port, head)
        assert answer.startswith(b"HTTP/1.1 403"), answer[:300]
        # a logged-in caller's body over 1 MiB is refused before it is read, too (400)
        answer = await raw_exchange(
            service.port,
            head.replace(
                b"Host: 127.0.0.1\r\n",
                f"Host: 127.0.0.1\r\nAuthorization: token {alice}\r\n".encode(),
            ),
        )
        assert answer.startswith(b"HTTP/1.1 400"), answer[:300]
        # a body up to the limit is read (and judged)
        code, data = await service.api(
            "POST", keep, b'{"seconds": 60, "pad": "' + b"x" * 500_000 + b'"}', token=alice
        )
        assert code == 200, data

        # every page and answer says where it may be shown and what it may load
        browser = await hub.browser("alice")
        try:
            page = await browser.request("/services/gpusnap/")
            assert page.code == 200, page.code
            for resp in (page, await browser.request("/services/gpusnap/api/info")):
                csp = resp.headers.get("Content-Security-Policy", "")
                assert "frame-ancestors 'self'" in csp and "script-src 'self'" in csp, csp
                assert "unsafe-inline" not in csp, csp
                assert resp.headers.get("X-Frame-Options") == "SAMEORIGIN"
        finally:
            browser.close()
        assert "Traceback" not in service.log_text(), service.log_text()[-3000:]
    finally:
        await service.stop()
