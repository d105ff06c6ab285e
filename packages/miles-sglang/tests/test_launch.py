"""The command lines SGLang engines are started with: 1-, 2- and 8-GPU layouts, environment, token,
and errors; then one engine started and restarted through the local executor.

SGLang needs CUDA and cannot run here. The last tests start a stand-in ``sglang.launch_server``
module (written into a temporary folder the plan's ``PYTHONPATH`` points at) that only answers
``/health`` and reports the argv and environment it was started with, and prints its arguments as
SGLang does: what they check is the wiring between config, plan, executor and process, not SGLang.
``scripts/h200/sglang_*.sh`` start the real one.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from miles.config import ConfigError, build_config
from miles.executor.local import LocalExecutor, free_port
from miles.kernel import Kernel
from miles_contracts import EngineSpec
from miles_contracts.cluster import Endpoint, ServiceLaunch
from miles_contracts.wire.auth import run_token
from miles_sglang import LaunchPlan, SGLangEngine, SGLangSection, launch_plan
from miles_sglang.launch import API_KEY_FROM_ENV, SGLangService

SPEC = EngineSpec(model_path="/models/qwen3-30b-a3b", port=30001, host="127.0.0.1", dtype="bfloat16")
QUIET_HEALTH = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}  # /health without a generation


def flags(argv: list[str]) -> dict[str, str | bool]:
    """``--flag value`` / ``--switch`` pairs of an argv after ``-m sglang.launch_server`` (or after
    the launcher that reads the token from the environment)."""
    entry = API_KEY_FROM_ENV if API_KEY_FROM_ENV in argv else "sglang.launch_server"
    rest = argv[argv.index(entry) + 1:]
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
    plan = launch_plan(SPEC, SGLangSection(**layout), authenticated=True, gpus=gpus)
    got = flags(plan.argv)
    # the token is read from MILES_AUTH_TOKEN inside the process: never in argv (ps, logs)
    assert plan.argv[:3] == [sys.executable, "-c", API_KEY_FROM_ENV] and "--api-key" not in plan.argv
    assert {k: got.get(k) for k in expected} == expected
    assert got["--model-path"] == SPEC.model_path and got["--port"] == "30001" and got["--host"] == "127.0.0.1"
    assert got["--dtype"] == "bfloat16" and got["--weight-version"] == "0"
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
    assert plan.argv[:3] == [sys.executable, "-m", "sglang.launch_server"]  # no token: an open server
    assert "--api-key" not in plan.argv and "--dtype" not in plan.argv  # dtype auto
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
    SGLangSection(sglang_args=["--chunked-prefill-size", "8192", "--enable-dp-attention", "--mem-fraction-static=0.5",
                               "--", "--host"])  # flags of SGLang's own; nothing after "--" is an option
    with pytest.raises(ValueError, match="runs on 2 GPUs, but 1 were given"):
        launch_plan(SPEC, SGLangSection(tp_size=2), gpus=[0])
    with pytest.raises(ValueError, match="dtype"):
        launch_plan(EngineSpec(model_path="/m", port=1, dtype="int4"), SGLangSection())


def _sglang_like_parser() -> argparse.ArgumentParser:
    """The owned options as SGLang declares them (name and aliases), with argparse's defaults."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    for dest, spellings in {"model_path": ["--model-path", "--model"], "host": ["--host"], "port": ["--port"],
                            "api_key": ["--api-key"], "tp_size": ["--tp-size", "--tensor-parallel-size"],
                            "ep_size": ["--ep-size", "--expert-parallel-size", "--ep"]}.items():
        parser.add_argument(*spellings, dest=dest)
    parser.add_argument("--chunked-prefill-size")
    return parser


@pytest.mark.parametrize(("args", "dest"), [
    (["--hos", "0.0.0.0"], "host"), (["--api-k", "x"], "api_key"), (["--api-key=x"], "api_key"),
    (["--model", "/other"], "model_path"), (["--tensor-parallel-size", "8"], "tp_size"), (["--tp=8"], "tp_size"),
    (["--po", "1"], "port"), (["--ep", "2"], "ep_size"),
])
def test_sglang_args_cannot_reach_a_flag_miles_sets_by_another_spelling(args, dest):
    # argparse (allow_abbrev, SGLang's parser) reads each of these as an option Miles sets, after
    # Miles' own value: an exact-name check let them move the engine off loopback or replace its token
    assert getattr(_sglang_like_parser().parse_args(args), dest) is not None
    with pytest.raises(ValueError, match="which Miles sets itself") as error:
        SGLangSection(sglang_args=args)
    assert f"--{dest.replace('_', '-')}" in str(error.value)


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
    argv = SGLangService({"MILES_AUTH_TOKEN": "tok-of-the-run"}).command(launch)
    assert "--config" not in argv and flags(argv)["--model-path"] == "/m"
    assert argv[:7] == ["env", "-u", "PYTHONPATH", "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false",
                        "/opt/sg/bin/python", "-c", API_KEY_FROM_ENV]
    assert not any("tok-of-the-run" in part for part in argv)  # the engine inherits it from the executor
    assert flags(argv)["--tp-size"] == "2" and flags(argv)["--port"] == "5"
    with pytest.raises(ValueError, match="resources.gpus_per_engine=2"):  # placement gave it one GPU
        SGLangService({}).command(ServiceLaunch(cfg, "/runs/r/config.yaml", "/m", Endpoint("127.0.0.1", 5), gpus=1))
    with pytest.raises(ConfigError) as error:
        build_config({"sglang": {"tp_sise": 2, "ep_size": 0}}, kernel=kernel)
    assert "tp_sise" in str(error.value) and "ep_size" in str(error.value)  # every error at once


def test_releasing_engine_memory_needs_the_memory_saver():
    """Without --enable-memory-saver SGLang answers /release_memory_occupation and frees nothing:
    the driver refuses the run before it starts anything, and says which setting to turn on."""
    from miles_contracts import Process, RunContext

    kernel = Kernel.load()
    plain = build_config({"rollout": {"engine": "sglang"}, "resources": {"release_engine_memory": "kv_cache"}},
                         kernel=kernel)
    with pytest.raises(ConfigError, match=r"release_engine_memory \(kv_cache\) needs SGLang's memory saver: set "
                                          r"sglang.enable_memory_saver: true"):
        kernel.configure(RunContext(plain, kernel, Process.driver(), None))
    kernel.configure(RunContext(plain, kernel, Process.trainer_rank(0), None))  # the driver's to refuse
    saver = build_config({"rollout": {"engine": "sglang"}, "resources": {"release_engine_memory": "all"},
                          "sglang": {"enable_memory_saver": True}}, kernel=kernel)
    kernel.configure(RunContext(saver, kernel, Process.driver(), None))
    launch = ServiceLaunch(saver, "/runs/r/config.yaml", "/m", Endpoint("127.0.0.1", 5), gpus=1)
    assert flags(SGLangService({}).command(launch))["--enable-memory-saver"] is True


STAND_IN = textwrap.dedent('''
    """Stand-in for sglang.launch_server (SGLang needs CUDA): prints its arguments at start-up as
    SGLang does (``server_args=ServerArgs(..., api_key=...)``), then serves /health and reports its
    argv and environment."""
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    key = args[args.index("--api-key") + 1] if "--api-key" in args else None
    print(f"server_args=ServerArgs(model_path={args[args.index('--model-path') + 1]!r}, port={port}, api_key={key!r})",
          flush=True)
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            env = {k: os.environ.get(k) for k in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES", "MILES_AUTH_TOKEN")}
            body = json.dumps({"argv": args, "env": env, "pid": os.getpid()}).encode()
            self.send_response(200); self.send_header("content-length", str(len(body))); self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a): pass
    HTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')


SPAWNING_STAND_IN = textwrap.dedent('''
    """Stand-in for sglang.launch_server that starts a process the way SGLang starts its scheduler
    (multiprocessing with "spawn", a function of this module as the target) and reports what both see."""
    import json, multiprocessing as mp, os, sys
    def scheduler(queue):
        queue.put({"argv": sys.argv[1:], "cmdline": open("/proc/self/cmdline", "rb").read().decode(errors="replace"),
                   "token_env": os.environ.get("MILES_AUTH_TOKEN")})
    if __name__ == "__main__":
        mp.set_start_method("spawn", force=True)
        queue = mp.Queue()
        child = mp.Process(target=scheduler, args=(queue,))
        child.start()
        print(json.dumps({"spec": __spec__.name, "argv": sys.argv[1:], "child": queue.get(timeout=60)}), flush=True)
        child.join()
''')


def test_the_launcher_runs_sglang_as_python_m_does(tmp_path):
    """SGLang sees --api-key in sys.argv, in its own process and in the processes it spawns; no
    command line holds the token, and without one the engine refuses to start."""
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (tmp_path / "sglang" / "launch_server.py").write_text(SPAWNING_STAND_IN)
    token = "the-token-of-this-run-0123456789"
    argv = launch_plan(EngineSpec(model_path="/m", port=1), SGLangSection(), authenticated=True).argv
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "MILES_AUTH_TOKEN": token}
    started = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    seen = json.loads(started.stdout)
    assert seen["spec"] == "sglang.launch_server"  # what `python -m` gives the module (spawn relies on it)
    assert seen["argv"][-2:] == ["--api-key", token] and seen["child"]["argv"] == seen["argv"]
    assert token not in seen["child"]["cmdline"] and seen["child"]["token_env"] is None
    refused = subprocess.run(argv, env={k: v for k, v in env.items() if k != "MILES_AUTH_TOKEN"}, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 1 and "MILES_AUTH_TOKEN is not set" in refused.stderr


def test_the_executor_starts_and_restarts_an_sglang_engine(tmp_path, monkeypatch):
    """The engine gets the run's token as --api-key, but no command line, log or environment of
    SGLang's own shows it: the stand-in prints it (as SGLang prints its server_args) and the log has
    the marker in its place."""
    token = run_token()
    assert token is not None  # the repository's conftest gives the session one, as `miles train` would
    site = tmp_path / "sg-site"
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("")
    (site / "sglang" / "launch_server.py").write_text(STAND_IN)
    monkeypatch.setenv("PYTHONPATH", "/somewhere/miles-site")  # Miles' own; must not reach SGLang
    section = SGLangSection(python=sys.executable, env={"PYTHONPATH": str(site), "CUDA_VISIBLE_DEVICES": "3"})
    spec = EngineSpec(model_path="/m", port=free_port(), options=section.options())
    argv = SGLangEngine().command(spec)
    executor = LocalExecutor(tmp_path / "run")
    try:
        executor.start("engine-0", argv, health_url=f"{spec.url}/health")
        first = json.load(urllib.request.urlopen(f"{spec.url}/server_info", timeout=10))
        assert first["env"] == {"PYTHONPATH": str(site), "CUDA_VISIBLE_DEVICES": "3", "MILES_AUTH_TOKEN": None}
        assert flags(["sglang.launch_server", *first["argv"]])["--api-key"] == token
        assert token.encode() not in Path(f"/proc/{first['pid']}/cmdline").read_bytes()
        executor.services()["engine-0"].process.kill()
        deadline = time.monotonic() + 10
        while executor.alive("engine-0") and time.monotonic() < deadline:
            time.sleep(0.05)
        executor.restart("engine-0")
        second = json.load(urllib.request.urlopen(f"{spec.url}/server_info", timeout=10))
        assert second["pid"] != first["pid"] and second["argv"] == first["argv"]
    finally:
        executor.shutdown()
    log = tmp_path / "run" / "logs" / "engine-0.log"
    text = log.read_text()
    assert text.count("api_key='[redacted]'") == 2 and token not in text  # both starts printed it
    assert stat.S_IMODE(log.stat().st_mode) == 0o600 and stat.S_IMODE(log.parent.stat().st_mode) == 0o700


def test_lora_runs_start_sglang_with_room_for_adapters_and_need_the_adapter_transport():
    """A train.lora run on SGLang: the engine's argv makes room for the adapters (rank, targets),
    and the driver refuses any weight transport but sglang_lora, naming the key and the fix."""
    from miles_contracts import Process, RunContext

    kernel = Kernel.load()
    lora = {"rank": 8, "target_modules": ["q_proj", "v_proj"]}
    cfg = build_config({"rollout": {"engine": "sglang"}, "train": {"lora": lora},
                        "weights": {"transport": "sglang_lora"}}, kernel=kernel)
    launch = ServiceLaunch(cfg, "/runs/r/config.yaml", "/m", Endpoint("127.0.0.1", 5), gpus=1, run_dir="/runs/r")
    argv = SGLangService({}).command(launch)
    at = argv.index("--enable-lora")
    assert argv[at:at + 6] == ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj"]
    kernel.configure(RunContext(cfg, kernel, Process.driver(), None))
    wrong = build_config({"rollout": {"engine": "sglang"}, "train": {"lora": lora}}, kernel=kernel)
    with pytest.raises(ConfigError, match=r"train.lora on SGLang engines needs weights.transport: sglang_lora "
                                          r"\(got 'shared_memory'\)"):
        kernel.configure(RunContext(wrong, kernel, Process.driver(), None))
