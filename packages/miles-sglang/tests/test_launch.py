"""The command lines SGLang engines are started with: 1-, 2- and 8-GPU layouts, environment, token,
and errors; then one engine started and restarted through the local executor.

SGLang needs CUDA and cannot run here. The last test starts a stand-in ``sglang.launch_server``
module (written into a temporary folder the plan's ``PYTHONPATH`` points at) that only answers
``/health`` and reports the argv and environment it was started with: what it checks is the wiring
between config, plan, executor and process, not SGLang. ``scripts/h200/sglang_*.sh`` start the
real one.
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
import urllib.request

import pytest
from miles.config import ConfigError, build_config
from miles.executor.local import LocalExecutor, free_port
from miles.kernel import Kernel
from miles_contracts import EngineSpec
from miles_contracts.cluster import Endpoint, ServiceLaunch
from miles_sglang import LaunchPlan, SGLangEngine, SGLangSection, launch_plan
from miles_sglang.launch import SGLangService

SPEC = EngineSpec(model_path="/models/qwen3-30b-a3b", port=30001, host="127.0.0.1", dtype="bfloat16")
QUIET_HEALTH = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}  # /health without a generation


def flags(argv: list[str]) -> dict[str, str | bool]:
    """``--flag value`` / ``--switch`` pairs of an argv after ``-m sglang.launch_server``."""
    rest = argv[argv.index("sglang.launch_server") + 1:]
    out: dict[str, str | bool] = {}
    for i, part in enumerate(rest):
        if part.startswith("--"):
            nxt = rest[i + 1] if i + 1 < len(rest) else None
            out[part] = nxt if nxt is not None and not nxt.startswith("--") else True
    return out


@pytest.mark.parametrize(("layout", "gpus", "expected"), [
    ({}, ["0"], {"--tp-size": "1", "--dp-size": "1", "--ep-size": "1"}),
    ({"tp_size": 2}, ["0", "1"], {"--tp-size": "2", "--dp-size": "1"}),
    ({"tp_size": 8, "ep_size": 8, "return_routed_experts": True}, [str(i) for i in range(8)],
     {"--tp-size": "8", "--ep-size": "8", "--enable-return-routed-experts": True}),
    ({"tp_size": 4, "dp_size": 2}, [str(i) for i in range(8)], {"--tp-size": "4", "--dp-size": "2"}),
    ({"tp_size": 8, "dp_size": 8, "sglang_args": ["--enable-dp-attention"]}, [str(i) for i in range(8)],
     {"--dp-size": "8", "--enable-dp-attention": True}),
], ids=["1gpu", "2gpu-tp2", "8gpu-tp8-ep8", "8gpu-tp4-dp2", "8gpu-dp-attention"])
def test_layouts(layout, gpus, expected):
    plan = launch_plan(SPEC, SGLangSection(**layout), token="s3cret", gpus=gpus)
    got = flags(plan.argv)
    assert plan.argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert {k: got.get(k) for k in expected} == expected
    assert got["--model-path"] == SPEC.model_path and got["--port"] == "30001" and got["--host"] == "127.0.0.1"
    assert got["--dtype"] == "bfloat16" and got["--api-key"] == "s3cret" and got["--weight-version"] == "0"
    assert plan.env == {"CUDA_VISIBLE_DEVICES": ",".join(gpus), **QUIET_HEALTH} and plan.unset == ()


def test_every_option_becomes_its_flag_and_extra_args_come_last():
    section = SGLangSection(mem_fraction_static=0.6, context_length=4096, max_running_requests=256,
                            attention_backend="fa3", skip_tokenizer_init=True, disable_radix_cache=True,
                            enable_memory_saver=True, weights_cpu_backup=True, load_format="dummy", random_seed=7,
                            log_level="info", sglang_args=["--chunked-prefill-size", "8192"])
    plan = launch_plan(EngineSpec(model_path="/m", port=1, device="cuda:0"), section)
    got = flags(plan.argv)
    assert {k: got[k] for k in ("--mem-fraction-static", "--context-length", "--max-running-requests",
                                "--attention-backend", "--load-format", "--random-seed", "--log-level", "--device")} == {
        "--mem-fraction-static": "0.6", "--context-length": "4096", "--max-running-requests": "256",
        "--attention-backend": "fa3", "--load-format": "dummy", "--random-seed": "7", "--log-level": "info",
        "--device": "cuda"}
    assert all(got[s] is True for s in ("--skip-tokenizer-init", "--disable-radix-cache", "--enable-memory-saver",
                                        "--enable-weights-cpu-backup"))
    assert plan.argv[-2:] == ["--chunked-prefill-size", "8192"]
    assert "--api-key" not in plan.argv and "--dtype" not in plan.argv  # no token: an open server; dtype auto
    assert "--enable-deterministic-inference" not in plan.argv
    deterministic = launch_plan(EngineSpec(model_path="/m", port=1, deterministic=True), SGLangSection())
    assert flags(deterministic.argv)["--enable-deterministic-inference"] is True  # run.deterministic


def test_sglang_runs_in_its_own_environment():
    own = launch_plan(SPEC, SGLangSection(python="/opt/sg/bin/python", health_generates=True))
    assert own.argv[0] == "/opt/sg/bin/python" and own.unset == ("PYTHONPATH",)
    assert own.command()[:4] == ["env", "-u", "PYTHONPATH", "/opt/sg/bin/python"]
    assert own.environment({"PYTHONPATH": "/tmp/site", "HOME": "/root"}) == {"HOME": "/root"}
    paths = launch_plan(SPEC, SGLangSection(python="/usr/bin/python3", env={"PYTHONPATH": "/tmp/sg"}))
    assert paths.unset == ()
    assert paths.environment({"PYTHONPATH": "/tmp/site"}) == {"PYTHONPATH": "/tmp/sg", **QUIET_HEALTH}
    assert paths.command()[:4] == ["env", "PYTHONPATH=/tmp/sg", "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false",
                                   "/usr/bin/python3"]
    assert LaunchPlan(["python"]).command() == ["python"]


def test_a_high_port_gets_a_grpc_port_sglang_accepts():
    # SGLang checks --port + 10000 <= 65535 at start-up even with its gRPC server off; the GPU run
    # that found this got port 58493 from the executor.
    high = launch_plan(EngineSpec(model_path="/m", port=58493), SGLangSection())
    assert high.env == {"SGLANG_GRPC_PORT": "48493", **QUIET_HEALTH}
    assert launch_plan(EngineSpec(model_path="/m", port=55535), SGLangSection()).env == QUIET_HEALTH
    chosen = launch_plan(EngineSpec(model_path="/m", port=60000), SGLangSection(env={"SGLANG_GRPC_PORT": "40000"}))
    assert chosen.env == {"SGLANG_GRPC_PORT": "40000", **QUIET_HEALTH}  # the user's own choice stays


def test_health_does_not_generate_unless_asked():
    # The router's /health probes, every few seconds, would each add a greedy one-token request to
    # the rollout's batch (~1 s each, and a sampling path SGLang JIT-builds on first use).
    assert launch_plan(SPEC, SGLangSection()).env == QUIET_HEALTH
    assert launch_plan(SPEC, SGLangSection(health_generates=True)).env == {}  # SGLang's own default
    own = launch_plan(SPEC, SGLangSection(env={"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "1"}))
    assert own.env == {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "1"}  # sglang.env wins


def test_bad_layouts_and_clashing_args_are_refused():
    with pytest.raises(ValueError, match="ep_size"):
        SGLangSection(tp_size=4, ep_size=3)
    with pytest.raises(ValueError, match="--port"):
        SGLangSection(sglang_args=["--port", "1"])
    with pytest.raises(ValueError, match="runs on 2 GPUs, but 1 were given"):
        launch_plan(SPEC, SGLangSection(tp_size=2), gpus=[0])
    with pytest.raises(ValueError, match="dtype"):
        launch_plan(EngineSpec(model_path="/m", port=1, dtype="int4"), SGLangSection())


def test_the_kernel_starts_sglang_from_the_run_config():
    kernel = Kernel.load()
    service = kernel.services().get("sglang")
    assert isinstance(service.command.__self__, SGLangService) and service.role == "engine"
    assert service.config_sections == ("model", "sglang")
    cfg = build_config({"rollout": {"engine": "sglang"}, "sglang": {"tp_size": 2, "python": "/opt/sg/bin/python"}},
                       kernel=kernel)
    # SGLang is an external program: its argv comes from the sglang section, not from the run's
    # config file (which only Miles' own servers read)
    launch = ServiceLaunch(cfg, "/runs/r/config.yaml", "/m", Endpoint("127.0.0.1", 5), gpus=2, run_dir="/runs/r")
    argv = SGLangService({"MILES_AUTH_TOKEN": "tok"}).command(launch)
    assert "--config" not in argv and flags(argv)["--model-path"] == "/m"
    assert argv[:5] == ["env", "-u", "PYTHONPATH", "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false",
                        "/opt/sg/bin/python"]
    assert flags(argv)["--tp-size"] == "2" and flags(argv)["--api-key"] == "tok" and flags(argv)["--port"] == "5"
    with pytest.raises(ValueError, match="resources.gpus_per_engine=2"):  # placement gave it one GPU
        SGLangService({}).command(ServiceLaunch(cfg, "/runs/r/config.yaml", "/m", Endpoint("127.0.0.1", 5), gpus=1))
    with pytest.raises(ConfigError) as error:
        build_config({"sglang": {"tp_sise": 2, "ep_size": 0}}, kernel=kernel)
    assert "tp_sise" in str(error.value) and "ep_size" in str(error.value)  # every error at once


STAND_IN = textwrap.dedent('''
    """Stand-in for sglang.launch_server (SGLang needs CUDA): /health, and its argv and env."""
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"argv": args, "env": {k: os.environ.get(k) for k in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")},
                               "pid": os.getpid()}).encode()
            self.send_response(200); self.send_header("content-length", str(len(body))); self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a): pass
    HTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')


def test_the_executor_starts_and_restarts_an_sglang_engine(tmp_path, monkeypatch):
    site = tmp_path / "sg-site"
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("")
    (site / "sglang" / "launch_server.py").write_text(STAND_IN)
    monkeypatch.setenv("PYTHONPATH", "/somewhere/miles-site")  # Miles' own; must not reach SGLang
    section = SGLangSection(python=sys.executable, env={"PYTHONPATH": str(site), "CUDA_VISIBLE_DEVICES": "3"})
    spec = EngineSpec(model_path="/m", port=free_port(), options=section.options())
    argv = SGLangEngine({"MILES_AUTH_TOKEN": "tok"}).command(spec)
    executor = LocalExecutor(tmp_path / "run")
    try:
        executor.start("engine-0", argv, health_url=f"{spec.url}/health")
        first = json.load(urllib.request.urlopen(f"{spec.url}/server_info", timeout=10))
        assert first["env"] == {"PYTHONPATH": str(site), "CUDA_VISIBLE_DEVICES": "3"}
        assert flags(["sglang.launch_server", *first["argv"]])["--api-key"] == "tok"
        executor.services()["engine-0"].process.kill()
        deadline = time.monotonic() + 10
        while executor.alive("engine-0") and time.monotonic() < deadline:
            time.sleep(0.05)
        executor.restart("engine-0")
        second = json.load(urllib.request.urlopen(f"{spec.url}/server_info", timeout=10))
        assert second["pid"] != first["pid"] and second["argv"] == first["argv"]
    finally:
        executor.shutdown()
