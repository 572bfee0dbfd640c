"""The OpenAPI description is valid and describes every route the service serves."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from openapi_spec_validator import validate

from jupyterhub_gpusnap.handlers import make_handlers

SPEC = Path(__file__).parent.parent / "docs" / "rest-api.yml"


def test_spec_is_valid_openapi():
    validate(yaml.safe_load(SPEC.read_text()))


def test_every_api_route_is_documented():
    spec = yaml.safe_load(SPEC.read_text())
    paths = set(spec["paths"])
    prefix = "/services/gpusnap/"
    for pattern, _handler in make_handlers(prefix):
        route = pattern[len(prefix) - 1 :]
        if not route.startswith(("/api", "/metrics")):
            continue  # pages and the OAuth callback are not API
        # turn the route regex into the spec's path templates (default and named server forms)
        base = re.sub(r"\(\?P<user>\[\^/\]\+\)\(\?:/\(\?P<name>\[\^/\]\*\)\)\?", "{user}", route)
        actions = re.search(r"\(\?P<action>([^)]*)\)", base)
        forms = [base]
        if "{user}" in base:
            forms.append(base.replace("{user}", "{user}/{name}"))
        for form in forms:
            for action in actions.group(1).split("|") if actions else [None]:
                path = form.replace(actions.group(0), action) if action else form
                assert path in paths, f"{path} (from {pattern}) is not in docs/rest-api.yml"
