"""The Hub-side config helpers and the docs that show them agree."""

from __future__ import annotations

import re
from pathlib import Path

from jupyterhub_gpusnap.hubconfig import (
    AUTH_STATE_SCOPE,
    JUPYTER_POLL_SCOPE,
    REQUIRED_SCOPES,
    server_token_scopes,
    service_role,
    user_role,
)

DOCS = Path(__file__).resolve().parent.parent / "docs"


def scope_rows(text: str) -> list[str]:
    return re.findall(r"^\| `([a-z:!=_]+)` \|", text, re.M)


def test_install_md_scope_table_is_required_scopes():
    text = (DOCS / "install.md").read_text()
    section = text[
        text.index("### The service's scopes") : text.index("Only where you turn them on")
    ]
    assert scope_rows(section) == list(REQUIRED_SCOPES)
    optional = text[text.index("Only where you turn them on") : text.index("## 3.")]
    assert set(scope_rows(optional)) == {AUTH_STATE_SCOPE, JUPYTER_POLL_SCOPE}


def test_security_md_scope_table_is_required_scopes_and_the_opt_ins():
    text = (DOCS / "security.md").read_text()
    section = text[
        text.index("## The service's scopes") : text.index("### What the service can reach")
    ]
    assert set(scope_rows(section)) == set(REQUIRED_SCOPES) | {AUTH_STATE_SCOPE, JUPYTER_POLL_SCOPE}


def test_the_service_role_opens_no_server_unless_polling_is_asked_for():
    assert "access:servers" not in REQUIRED_SCOPES
    assert not any(s.startswith("access:servers") for s in service_role("gpusnap")["scopes"])
    assert JUPYTER_POLL_SCOPE in service_role("gpusnap", jupyter_poll=True)["scopes"]
    assert AUTH_STATE_SCOPE in service_role("gpusnap", email_from_auth_state=True)["scopes"]


def test_server_tokens_and_users_reach_the_service():
    assert server_token_scopes("snap") == [
        "users:activity!user",
        "access:servers!server",
        "access:services!service=snap",
    ]
    assert user_role("snap") == {"name": "user", "scopes": ["self", "access:services!service=snap"]}
