"""One config hand-off to every child process (issue 25, item 4).

A run's services -- the engine, the router, the session server -- are started as the run starts
them: their registered ``ServiceSpec.command`` with a ``ServiceLaunch`` whose ``config_path`` is
the run's config file, through the local executor. Each process reads its settings from that file
and loads its kernel for the file's ``plugins`` section, never for the environment alone.

Two plugin distributions are installed for the child processes only (a folder with
``*.dist-info/entry_points.txt`` on their ``PYTHONPATH``; this process never sees them):

* ``boom``, whose import raises: with ``plugins.disable: [boom]`` in the config every service
  starts and serves; without it, each refuses to start and names the plugin;
* ``stamp``, which registers a router middleware and a chat family: the router builds its chain
  with it (``RouterMiddlewareSpec.create`` gets the router's own run context) and the session
  server resolves ``tito.family`` with it -- names only the config's kernel can know.
"""

from __future__ import annotations

import argparse
import os
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from miles.cli.section_args import add_section_arguments, section_overrides
from miles.config import apply_overrides, load_config
from miles.executor.local import LocalExecutor, ServiceError
from miles.kernel import Kernel
from miles.sections import Section
from miles_contracts import Endpoint, ServiceLaunch
from miles_contracts.cluster import ENGINE, ROUTER, SESSION
from miles_contracts.testing.processes import wait_ready
from miles_contracts.wire.auth import auth_headers
from pydantic import Field

BOOM = "raise RuntimeError('the boom plugin must never be imported')\n"

STAMP = '''
    """A router middleware stamping each response with the context it was built with, and a copy of
    the ChatML family under another name."""

    import dataclasses

    from miles import hookimpl
    from miles_contracts import RouterMiddlewareSpec


    class Stamp:
        def __init__(self, ctx, options):
            self.value = f"{ctx.process}|{ctx.run_dir}|{options['label']}"

        async def __call__(self, request, call_next):
            response = await call_next(request)
            response.headers["x-stamp"] = self.value
            return response


    @hookimpl
    def miles_register_router_middlewares(register):
        register("stamp", RouterMiddlewareSpec(Stamp))


    @hookimpl
    def miles_register_chat_families(register):
        from miles_model_llama.chat import chatml_family

        register("stamped", dataclasses.replace(chatml_family(), name="stamped"))
'''

RUN_CONFIG = """\
model: {device: cpu, dtype: float32}
engine: {max_running_requests: 3, context_length: 256}
router:
  middlewares: [stamp]
  middleware_options: {stamp: {label: from-the-config}}
  health_interval: 0.2
tito: {family: stamped}
rollout: {max_new_tokens: 7}
"""


def _install(site: Path, name: str, source: str) -> None:
    """A distribution ``miles-<name>`` whose entry point ``<name>`` in group ``miles`` is module
    ``miles_<name>_plugin``, as ``pip install`` would leave it in ``site``."""
    (site / f"miles_{name}_plugin.py").write_text(textwrap.dedent(source).lstrip())
    info = site / f"miles_{name}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: miles-{name}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[miles]\n{name} = miles_{name}_plugin\n")


@pytest.fixture(scope="module")
def child_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of the services: the two plugins installed."""
    site = tmp_path_factory.mktemp("site")
    _install(site, "boom", BOOM)
    _install(site, "stamp", STAMP)
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)}


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


class Run:
    """The services of a run started as ``miles.loop.services`` starts them."""

    def __init__(self, run_dir: Path, config_text: str, env: Mapping[str, str]) -> None:
        self.run_dir = run_dir.resolve()
        self.run_dir.mkdir(parents=True)
        self.config_path = self.run_dir / "config.yaml"
        self.config_path.write_text(config_text)
        self.kernel = Kernel.load()  # the services this process knows how to start
        self.executor = LocalExecutor(self.run_dir, startup_timeout=300)
        self.env = dict(env)

    def launch(self, role: str, service: str, model_path: str, upstream: Mapping[str, Sequence[str]]) -> None:
        spec = self.kernel.services().get(service)
        assert spec.role == role
        # launch.config is what the driver decides with; none of these three reads it: the
        # processes read the file (whose plugin names this process does not even know)
        config = load_config()

        def command(endpoint: Endpoint) -> list[str]:
            launch = ServiceLaunch(config, str(self.config_path), model_path, endpoint, upstream,
                                   run_dir=str(self.run_dir))
            return list(spec.command(launch))

        self.executor.launch(role, command, health_path=spec.health_path, env=self.env)

    def url(self, role: str) -> str:
        return self.executor.endpoint(role).url

    def argv(self, role: str) -> list[str]:
        return self.executor.services()[role].argv


@pytest.fixture
def start(run_dir: Path, child_env: dict[str, str]) -> Iterator:
    runs: list[Run] = []

    def make(config_text: str) -> Run:
        runs.append(Run(run_dir, config_text, child_env))
        return runs[-1]

    yield make
    for run in runs:
        run.executor.shutdown()


@pytest.mark.slow  # three real servers on the tiny model
def test_every_service_reads_the_runs_config_and_loads_its_plugin_selection(start, tiny_dense: Path) -> None:
    run = start("plugins: {disable: [boom]}\n" + RUN_CONFIG)
    run.launch(ENGINE, "embedded", str(tiny_dense), {})
    run.executor.wait_healthy(ENGINE)
    run.launch(ROUTER, "router", str(tiny_dense), {ENGINE: [run.url(ENGINE)]})
    run.executor.wait_healthy(ROUTER)
    run.launch(SESSION, "session", str(tiny_dense), {ROUTER: [run.url(ROUTER)]})
    run.executor.wait_healthy(SESSION)

    for role in (ENGINE, ROUTER, SESSION):  # what the launch decides, and the file for the rest
        argv = run.argv(role)
        assert argv[argv.index("--config") + 1] == str(run.config_path)
        assert argv[argv.index("--run-dir") + 1] == str(run.run_dir)

    with httpx.Client(timeout=120, headers=auth_headers()) as http:
        info = http.get(f"{run.url(ENGINE)}/get_server_info").json()
        assert (info["max_running_requests"], info["context_length"]) == (3, 256)  # the engine section

        def router_serves() -> bool:
            return http.get(f"{run.url(ROUTER)}/health").status_code == 200

        router = run.executor.services()[ROUTER]
        wait_ready(router_serves, "the router serving the engine", process=router.process, log=router.log_path)
        answer = http.post(f"{run.url(ROUTER)}/generate",
                           json={"text": "hi", "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
        assert answer.status_code == 200
        # built by the router process's kernel, with its own context and the section's options
        assert answer.headers["x-stamp"] == f"router service|{run.run_dir}|from-the-config"

        info = http.get(f"{run.url(SESSION)}/server_info").json()
        assert info["family"] == "stamped"  # tito.family, from the config's kernel
        session = http.post(f"{run.url(SESSION)}/sessions").json()
        chat = http.post(f"{session['base_url']}/chat/completions",
                         headers={"Authorization": f"Bearer {session['api_key']}"},
                         json={"messages": [{"role": "user", "content": "hi"}], "min_tokens": 7})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] == 7  # rollout.max_new_tokens is the default budget


@pytest.mark.slow
def test_without_the_disable_every_service_refuses_to_start_naming_the_plugin(start, tiny_dense: Path) -> None:
    run = start(RUN_CONFIG)
    run.launch(ENGINE, "embedded", str(tiny_dense), {})
    run.launch(ROUTER, "router", str(tiny_dense), {ENGINE: ["http://127.0.0.1:9"]})
    run.launch(SESSION, "session", str(tiny_dense), {ROUTER: ["http://127.0.0.1:9"]})
    for role in (ENGINE, ROUTER, SESSION):
        with pytest.raises(ServiceError) as refused:
            run.executor.wait_healthy(role)
        message = str(refused.value)
        assert "exited with code 2 during start-up" in message
        assert "plugin 'boom'" in message and "failed to import" in message
        assert "plugins.disable: [boom]" in message  # and how to turn it off


class Demo(Section):
    """A section with a field of every shape the flags know."""

    on: bool = Field(default=True, description="switch")
    mode: Literal["fast", "slow"] = "fast"
    names: list[str] = Field(default_factory=list)
    levels: list[Literal["a", "b"]] = Field(default_factory=lambda: ["a"])
    options: dict[str, Any] = Field(default_factory=dict, description="free-form")
    label: str | None = None
    rate: float = Field(default=0.5, gt=0, description="a share (100% is 1)")
    count: int = Field(default=1, ge=1)
    folder: Path = Path("out")
    pair: tuple[float, float] = (0.9, 0.99)


def test_flags_derived_from_a_section_come_back_as_the_values_given() -> None:
    parser = argparse.ArgumentParser()
    add_section_arguments(parser, "demo", Demo, flags={"names": ("--name", "-n")})
    text = parser.format_help()  # descriptions (a % included), config keys and defaults
    assert "a share (100% is 1) (demo.rate; default 0.5)" in " ".join(text.split())
    assert "--on, --no-on" in text and "{fast,slow}" in text and "--options JSON" in text
    assert section_overrides(parser.parse_args([])) == []  # nothing given: the file's values stand
    args = parser.parse_args(["--no-on", "--mode", "slow", "--name", "0.5", "-n", "x y", "--levels", "b",
                              "--options", '{"k": [1, "2"], "null": null}', "--label", "true", "--rate", "1e-7",
                              "--count", "3", "--folder", "/tmp/x: y", "--pair", "[0.1, 0.2]"])
    data: dict[str, Any] = {}
    assert apply_overrides(data, section_overrides(args)) == []
    # strings stay strings however they look; lists replace, mappings and tuples go as JSON
    assert Demo.model_validate(data["demo"]) == Demo(
        on=False, mode="slow", names=["0.5", "x y"], levels=["b"], options={"k": [1, "2"], "null": None},
        label="true", rate=1e-7, count=3, folder=Path("/tmp/x: y"), pair=(0.1, 0.2))
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "medium"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--options", "{not json"])
