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
from test_access_matrix import start_hub_and_service

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
        "POST /api/servers/{user}/exempt",
        "POST /api/servers/{user}/{name}/exempt",
        "GET /api/events",
        "POST /api/make-room",
        "GET /metrics",
    }, labels
