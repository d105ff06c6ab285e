"""Schemathesis against the OpenAPI documents of the engine and the session server, and the
engine's data routes through a router: whatever a client sends that the schema describes (and
much that it does not), the answer is never a 5xx.

Examples are bounded (a few per operation) to keep the suite fast; the engine runs with a
128-token context so that a generated ``max_new_tokens`` cannot make one example slow. Routes that
would change what the shared engine serves for the rest of the module (pause, joining a weight
group, filling the weights with noise) are fuzzed by their own focused tests instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from miles_contracts.wire.auth import auth_headers
from miles_contracts.wire.engine import DATA, ENGINE_ROUTES
from miles_engine.openapi import engine_openapi
from miles_tito.server.openapi import session_openapi
from security_support import serve_engine

# /update_weights_from_mooncake makes the engine connect to the host its body names: generated
# hosts must never be contacted (tests/security/test_mooncake.py covers its bounds)
EXCLUDED = {"/pause_generation", "/init_weights_update_group", "/fill_weights_noise", "/update_weights_from_mooncake"}
EXAMPLES = settings(max_examples=6, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))

engine_schema = schemathesis.openapi.from_dict(engine_openapi())
session_schema = schemathesis.openapi.from_dict(session_openapi())


@pytest.fixture(scope="module")
def fuzzed_engine(tiny_dense: Path) -> Iterator[str]:
    for served in serve_engine(tiny_dense):
        yield served.url


@engine_schema.parametrize()
@EXAMPLES
def test_the_engine_answers_no_5xx(case, fuzzed_engine: str) -> None:
    if case.path in EXCLUDED:
        pytest.skip("changes what the engine serves; tested on its own")
    response = case.call(base_url=fuzzed_engine, headers=auth_headers(), timeout=60)
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:300]}"


@pytest.fixture(scope="module")
def fuzzed_router(fuzzed_engine: str) -> Iterator[str]:
    from miles_router import RouterServer
    from miles_router.config import RouterSection

    with RouterServer([fuzzed_engine], section=RouterSection(health_interval=0.2, health_timeout=5.0)) as server:
        yield server.url


@engine_schema.parametrize()
@EXAMPLES
def test_the_router_answers_no_5xx_on_the_engine_data_routes(case, fuzzed_router: str) -> None:
    """The router parses and re-sends every body and path itself (its fan-out and control routes
    are tested in test_bad_input.py and the router's own suite)."""
    if ENGINE_ROUTES[case.path] != DATA:
        pytest.skip("not a data route")
    response = case.call(base_url=fuzzed_router, headers=auth_headers(), timeout=60)
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:300]}"


@session_schema.parametrize()
@EXAMPLES
def test_the_session_server_answers_no_5xx(case, session_server) -> None:
    response = case.call(base_url=session_server.url, headers=auth_headers(), timeout=60)
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:300]}"
