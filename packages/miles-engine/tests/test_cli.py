"""The engine as the rest of Miles starts it: the ``embedded`` inference engine's argv (a real
``python -m miles_engine`` process reading its settings from a config file, as a run's engines
read the run's ``config.yaml``), ``miles serve engine``, and the one table of engine options (the
``engine`` config section, the flags, ``Engine(path, **options)``)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from engine_support import free_port
from miles.cli.main import main as miles_main
from miles.cli.section_args import section_overrides
from miles.config import ConfigError, build_config, load_config
from miles.kernel import Kernel
from miles_contracts import Endpoint, ServiceLaunch
from miles_contracts.testing.processes import LoggedProcess
from miles_contracts.wire.auth import auth_headers
from miles_engine.config import EngineConfig, engine_config, engine_config_of
from miles_engine.launcher import ENGINE_SERVICE
from miles_engine.options import EngineSection
from miles_engine.serve import STATS_PREFIX, add_arguments


@pytest.fixture(scope="module")
def kernel():
    return Kernel.load()


def _launch(config, config_path: Path, model: str = "m", *, port: int = 1, run_dir: str = "") -> ServiceLaunch:
    return ServiceLaunch(config, str(config_path), model, Endpoint("127.0.0.1", port), run_dir=run_dir)


def test_embedded_engine_is_registered_and_starts_a_server_from_the_config(kernel, dense_path, tmp_path):
    assert kernel.services().get("embedded") is ENGINE_SERVICE
    config = build_config({"model": {"device": "cpu"}, "engine": {"max_running_requests": 4, "context_length": 512}},
                          kernel=kernel)
    config_path = tmp_path / "config.yaml"
    config_path.write_text(config.to_yaml())
    port = free_port()
    argv = ENGINE_SERVICE.command(_launch(config, config_path, str(dense_path), port=port, run_dir=str(tmp_path)))
    assert argv[:3] == [sys.executable, "-m", "miles_engine"]
    assert "--max-running-requests" not in argv  # the settings travel in the file
    with LoggedProcess(argv, tmp_path / "engine.log") as process:
        process.wait_healthy(f"http://127.0.0.1:{port}")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60, headers=auth_headers()) as client:
            out = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
            assert out.status_code == 200 and len(out.json()["output_ids"]) == 3
            info = client.get("/get_server_info").json()
            assert info["max_running_requests"] == 4 and info["context_length"] == 512
    # stopped (SIGTERM, as a run stops its engines): its last words are its batching statistics
    [stats] = [line.removeprefix(STATS_PREFIX) for line in (tmp_path / "engine.log").read_text().splitlines()
               if line.startswith(STATS_PREFIX)]
    stats = json.loads(stats)
    assert stats["prefill_requests"] == 1 and stats["decode_tokens"] == 2  # the prefill samples the first token


def test_an_engine_whose_port_is_taken_exits_98_and_never_says_it_serves(dense_path):
    """It listens before loading the model: the executor learns in seconds, from the exit status
    (EXIT_ADDRESS_IN_USE), that it must pick another port. It used to print "serving", lose its
    HTTP thread and run on without a port, forever."""
    import socket

    from miles_contracts.cluster import EXIT_ADDRESS_IN_USE

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "miles_engine", "--model", str(dense_path), "--device", "cpu",
                               "--port", str(port)], capture_output=True, text=True, timeout=300)
    assert done.returncode == EXIT_ADDRESS_IN_USE, done.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}: the address is already in use" in done.stderr
    assert "serving" not in done.stdout + done.stderr


def test_the_run_decides_only_the_launch_values(tmp_path):
    config = load_config()
    argv = ENGINE_SERVICE.command(_launch(config, tmp_path / "config.yaml", "/models/m", port=4000,
                                          run_dir=str(tmp_path)))
    assert argv[3:] == ["--model", "/models/m", "--host", "127.0.0.1", "--port", "4000",
                        "--config", str(tmp_path / "config.yaml"), "--run-dir", str(tmp_path)]
    with pytest.raises(ValueError, match="resources.gpus_per_engine=1"):
        ENGINE_SERVICE.command(ServiceLaunch(config, "c.yaml", "m", Endpoint("127.0.0.1", 1), gpus=2))


def test_serve_engine_command_is_registered_with_its_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        miles_main(["serve", "engine", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--model", "--port", "--config", "--device", "--dtype", "--max-running-requests", "--context-length",
                 "--max-kv-tokens", "--plain-linear", "--enable-deterministic-inference"):
        assert flag in help_text


def test_serve_engine_with_an_unknown_model_fails_clearly(capsys):
    assert miles_main(["serve", "engine", "--model", "no-such-model-anywhere"]) == 2
    assert "neither a local folder nor a known model" in capsys.readouterr().err


def test_every_engine_option_is_a_flag_and_a_config_key():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--max-running-requests", "8", "--plain-linear", "--weight-dir", "/a", "--weight-dir",
                              "/b", "--device", "cpu", "--enable-deterministic-inference"])
    overrides = section_overrides(args)
    assert overrides == ["model.device=cpu", "run.deterministic=true", "engine.max_running_requests=8",
                         "engine.plain_linear=true", "engine.weight_dir=[/a, /b]"]
    settings = engine_config_of(load_config(None, overrides), "/models/m", run_dir="/runs/r")
    assert (settings.max_running_requests, settings.plain_linear, settings.device) == (8, True, "cpu")
    assert settings.enable_deterministic_inference and settings.weight_dir == ["/a", "/b", "/runs/r"]
    # the one table: each option of the section is a keyword of Engine(path, **options) and a flag
    flags = {option for action in parser._actions for option in action.option_strings}
    for name in EngineSection.model_fields:
        assert name in EngineConfig.model_fields and "--" + name.replace("_", "-") in flags
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-runing-requests", "8"])


def test_engine_config_section(kernel, tmp_path):
    cfg = build_config({"engine": {"max_running_requests": 16}}, kernel=kernel)
    assert cfg.section("engine", EngineSection).max_running_requests == 16
    with pytest.raises(ConfigError, match="engine.max_running_requests"):
        build_config({"engine": {"max_running_requests": 0}}, kernel=kernel)
    with pytest.raises(ConfigError, match="typo"):
        build_config({"engine": {"typo": 1}}, kernel=kernel)
    config = tmp_path / "config.yaml"
    config.write_text("engine:\n  max_running_requests: 16\n")
    assert miles_main(["serve", "engine", "--config", str(config), "--max-running-requests", "0"]) == 2  # flags win


def test_the_python_api_validates_options_with_the_same_table():
    assert engine_config("m", max_running_requests=8, device="cuda:1").max_running_requests == 8
    with pytest.raises(ValueError, match="max_running_requests must be >= 1, got 0.*unknown option 'max_runing'"):
        engine_config("m", max_running_requests=0, max_runing=1)
    with pytest.raises(ValueError, match="device"):
        engine_config("m", device="tpu")


def test_run_deterministic_starts_the_engine_in_deterministic_mode():
    plain = engine_config_of(load_config(), "m")
    seeded = engine_config_of(load_config(None, ["run.deterministic=true"]), "m")
    assert not plain.enable_deterministic_inference and seeded.enable_deterministic_inference
