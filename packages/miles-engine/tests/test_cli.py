"""The engine as the rest of Miles starts it: the ``embedded`` inference engine's argv (a real
``python -m miles_engine`` process), ``miles serve engine``, and the ``engine`` config section."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from engine_support import free_port, wait_until
from miles.cli.main import main as miles_main
from miles.config import ConfigError, build_config
from miles.kernel import Kernel
from miles_contracts import EngineSpec
from miles_contracts.wire.auth import auth_headers
from miles_engine.launcher import EmbeddedEngine, EngineService
from miles_engine.options import EngineSection, options_argv


@pytest.fixture(scope="module")
def kernel():
    return Kernel.load()


def test_embedded_engine_is_registered_and_starts_a_server(kernel, dense_path):
    assert isinstance(kernel.services().get("embedded"), EngineService)
    engine = EmbeddedEngine()
    spec = EngineSpec(model_path=str(dense_path), port=free_port(), device="cpu",
                      options={"max_running_requests": 4, "context_length": 512})
    argv = engine.command(spec)
    assert argv[:3] == [sys.executable, "-m", "miles_engine"]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        with httpx.Client(base_url=spec.url, timeout=60, headers=auth_headers()) as client:
            def healthy() -> bool:
                if process.poll() is not None:
                    raise AssertionError(f"engine exited: {process.stderr.read()[-2000:]}")
                try:
                    return client.get("/health").status_code == 200
                except httpx.TransportError:
                    return False

            wait_until(healthy, timeout=180, interval=0.2)
            out = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
            assert out.status_code == 200 and len(out.json()["output_ids"]) == 3
            info = client.get("/get_server_info").json()
            assert info["max_running_requests"] == 4 and info["context_length"] == 512
    finally:
        process.terminate()
        process.wait(30)


def test_serve_engine_command_is_registered_with_its_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        miles_main(["serve", "engine", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--model", "--port", "--device", "--dtype", "--max-running-requests", "--context-length",
                 "--max-kv-tokens", "--plain-linear"):
        assert flag in help_text


def test_serve_engine_with_an_unknown_model_fails_clearly(capsys):
    assert miles_main(["serve", "engine", "--model", "no-such-model-anywhere"]) == 2
    assert "neither a local folder nor a known model" in capsys.readouterr().err


def test_engine_options_become_flags_and_unknown_ones_are_refused():
    assert options_argv({"max_running_requests": 8, "plain_linear": True, "context_length": None}) == [
        "--max-running-requests", "8", "--plain-linear"]
    with pytest.raises(ValueError, match="unknown embedded-engine option"):
        options_argv({"max_runing_requests": 8})


def test_engine_config_section(kernel):
    cfg = build_config({"engine": {"max_running_requests": 16}}, kernel=kernel)
    section = cfg.section("engine", EngineSection)
    assert section.max_running_requests == 16
    assert options_argv(section.options())[:2] == ["--max-running-requests", "16"]
    with pytest.raises(ConfigError, match="max_running_requests"):
        build_config({"engine": {"max_running_requests": 0}}, kernel=kernel)
    with pytest.raises(ConfigError, match="typo"):
        build_config({"engine": {"typo": 1}}, kernel=kernel)


def test_a_deterministic_spec_starts_the_engine_in_deterministic_mode():
    engine = EmbeddedEngine()
    plain = engine.command(EngineSpec(model_path="m", port=1, options={"max_running_requests": 4}))
    seeded = engine.command(EngineSpec(model_path="m", port=1, options={"max_running_requests": 4}, deterministic=True))
    assert "--enable-deterministic-inference" not in plain
    assert seeded == [*plain, "--enable-deterministic-inference"]  # SGLang's flag of the same meaning
