"""LoRA runs on SGLang: the router adds the chosen engine's adapter (``lora_path``) to each
``/generate`` it forwards, and labels the answer with the version of that adapter.

The engine is the router tests' stand-in (router_support.StandinEngine: records bodies, reports a
weight_version the test sets), since SGLang needs a GPU; the router is the real one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from miles.config import build_config
from miles.kernel import Kernel
from miles_contracts import Process, RunContext
from miles_contracts.wire.auth import auth_headers
from miles_router.config import RouterSection
from miles_router.server import RouterServer
from router_support import StandinEngine

PROMPT = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}


def _context(engine: str, lora: bool) -> RunContext:
    kernel = Kernel.load()
    overrides: dict[str, Any] = {"rollout": {"engine": engine}}
    if lora:
        overrides.update(train={"lora": {"rank": 4}}, weights={"transport": "sglang_lora"})
    return RunContext(build_config(overrides, kernel=kernel), kernel, Process.driver(), Path("/runs/r"))


def _generate(router: RouterServer, **extra: Any) -> dict[str, Any]:
    response = httpx.post(router.url + "/generate", json={**PROMPT, **extra}, headers=auth_headers(), timeout=10)
    response.raise_for_status()
    answer: dict[str, Any] = response.json()
    return answer


def test_requests_name_the_adapter_of_their_engines_version(engines: list[StandinEngine]) -> None:
    engine = engines[0]
    section = RouterSection(health_interval=3600)  # versions learnt from answers only: deterministic
    with RouterServer([engine.url], section=section, ctx=_context("sglang", lora=True)) as router:
        assert _generate(router)["meta_info"]["weight_version"] == "0"
        assert "lora_path" not in engine.received[-1][1]  # before the first sync: the base
        engine.version = "3"  # a sync loaded miles-v3 on the engine, behind the router's back
        # the router still knows the engine at 0: the base served it, and the answer says so
        assert _generate(router)["meta_info"]["weight_version"] == "0"
        assert "lora_path" not in engine.received[-1][1]
        assert _generate(router)["meta_info"]["weight_version"] == "3"  # the answer taught it v3
        assert engine.received[-1][1] == {**PROMPT, "lora_path": "miles-v3"}
        engine.version = "4"
        assert _generate(router, stream=False)["meta_info"]["weight_version"] == "3"  # served by miles-v3
        assert engine.received[-1][1]["lora_path"] == "miles-v3"
        _generate(router)
        assert engine.received[-1][1]["lora_path"] == "miles-v4"


def test_other_runs_forward_the_body_unchanged(engines: list[StandinEngine]) -> None:
    engine = engines[0]
    engine.version = "5"
    for ctx in (_context("embedded", lora=True), _context("sglang", lora=False)):
        with RouterServer([engine.url], ctx=ctx) as router:
            assert _generate(router)["meta_info"]["weight_version"] == "5"
            assert engine.received[-1][1] == PROMPT
