"""The engine contract suite (``miles_contracts.testing.engine``) against the embedded engine.

The same checks run against a live SGLang server on the H200 (``scripts/h200/sglang_contract.sh``),
so passing here and there means the two engines answer Miles' requests the same way.
"""

from __future__ import annotations

import pytest
from engine_support import serve_engine
from miles_contracts.testing.engine import ENGINE_CHECKS, EngineCheckSkipped, EngineUnderTest
from miles_contracts.wire.auth import run_token


@pytest.fixture(scope="module")
def engine_under_test(dense_path):
    with serve_engine(dense_path, max_running_requests=8) as running:
        yield EngineUnderTest(running.url, token=run_token(), model_path=str(dense_path), long_tokens=600,
                              settle_s=0.3)


@pytest.mark.parametrize("check", list(ENGINE_CHECKS))
def test_embedded_engine_meets_the_engine_contract(engine_under_test, check):
    try:
        ENGINE_CHECKS[check](engine_under_test)
    except EngineCheckSkipped as exc:
        pytest.skip(str(exc))
