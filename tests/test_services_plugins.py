"""Services are plugins: which processes a run starts comes from what packages register
(``miles_register_services``) and what the generator asks for, not from names in the kernel."""

from __future__ import annotations

import sys

import pytest
from miles import hookimpl
from miles.config import build_config
from miles.errors import ConfigError, MilesError
from miles.kernel import Kernel
from miles.loop.services import _waves, plan_services
from miles.placement import plan_placement
from miles_contracts import Endpoint, GeneratorSpec, Node, ServiceLaunch


def _plan(kernel: Kernel, **sections):
    config = build_config({"rollout": {"agent": "calculator_agent"}, **sections}, kernel=kernel)
    placement = plan_placement(config.resources, [Node("local", "127.0.0.1")])
    return config, plan_services(config, kernel, placement)


def test_a_single_turn_run_starts_engines_and_the_router() -> None:
    _, planned = _plan(Kernel.load(), resources={"engines": 2})
    assert [(p.name, p.role) for p in planned] == [("engine-0", "engine"), ("engine-1", "engine"), ("router", "router")]
    assert [[p.name for p in wave] for wave in _waves(planned)] == [["engine-0", "engine-1"], ["router"]]


def test_the_agentic_generator_asks_for_the_session_server_which_needs_the_router() -> None:
    config, planned = _plan(Kernel.load(), rollout={"generator": "agentic", "agent": "calculator_agent"},
                            tito={"max_branches_per_episode": 2})
    assert [[p.name for p in wave] for wave in _waves(planned)] == [["engine-0"], ["router"], ["session"]]
    session = next(p for p in planned if p.role == "session")
    argv = session.service.command(ServiceLaunch(config, "/runs/r/config.yaml", "/models/m", Endpoint("127.0.0.1", 4000),
                                                 {"router": ["http://127.0.0.1:3000"]}))
    assert argv[:3] == [sys.executable, "-m", "miles_tito.server"]
    assert argv[argv.index("--router") + 1] == "http://127.0.0.1:3000" and argv[argv.index("--port") + 1] == "4000"
    # the tito section reaches the process in the run's config file, not spelled as flags
    assert argv[argv.index("--config") + 1] == "/runs/r/config.yaml" and "--max-branches-per-episode" not in argv


def test_the_router_gets_its_engines_and_the_runs_config_file() -> None:
    config, planned = _plan(Kernel.load(), router={"forward_client": "httpx", "max_attempts": 5})
    router = next(p for p in planned if p.role == "router")
    assert router.service.config_sections == ("router",)
    argv = router.service.command(ServiceLaunch(config, "/runs/r/config.yaml", "/m", Endpoint("10.0.0.1", 3000),
                                                {"engine": ["http://10.0.0.2:1", "http://10.0.0.3:2"]}))
    assert argv[argv.index("--host") + 1] == "10.0.0.1"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--worker"] == ["http://10.0.0.2:1", "http://10.0.0.3:2"]
    assert argv[argv.index("--config") + 1] == "/runs/r/config.yaml"
    assert "--forward-client" not in argv and "--max-attempts" not in argv  # the section travels in the file


async def _judged(sample, ctx):
    return sample


class _ThirdParty:
    """A third-party generator that needs a service role nobody registers."""

    @hookimpl
    def miles_register_generators(self, register):
        register("judged", GeneratorSpec(_judged, services=("judge",)))


@pytest.fixture
def kernel():
    kernel = Kernel.load()
    kernel.register_plugin(_ThirdParty(), name="third-party")
    yield kernel
    kernel.unregister_plugin("third-party")


def test_a_generator_of_another_package_declares_what_it_needs(kernel) -> None:
    # found when the config is checked, before any process starts
    with pytest.raises(ConfigError, match="rollout.generator: 'judged' needs a 'judge' service and none is installed"):
        build_config({"rollout": {"generator": "judged"}}, kernel=kernel)
    config = build_config({"rollout": {"generator": "judged"}}, kernel=kernel, check_names=False)
    with pytest.raises(MilesError, match="needs a 'judge' service and none is installed"):
        plan_services(config, kernel, plan_placement(config.resources, [Node("local", "127.0.0.1")]))


def test_a_run_without_the_router_fails_at_config_check_naming_its_package() -> None:
    with pytest.raises(ConfigError) as info:
        build_config({"plugins": {"disable": ["router"]}})
    assert ("rollout.generator: 'single_turn' needs a 'router' service and none is installed; it comes with "
            "miles-router, whose plugin 'router' is installed but blocked") in str(info.value)


def test_rollout_engine_must_name_an_engine_service() -> None:
    with pytest.raises(ConfigError, match="rollout.engine: 'router' is a router service, not an engine; engines: embedded"):
        build_config({"rollout": {"engine": "router"}})


def test_disaggregated_gpus_refuse_a_transport_that_needs_the_trainers_gpu(tmp_path) -> None:
    from miles.executor.local import LocalExecutor
    from miles.loop.runner import place

    kernel = Kernel.load()
    executor = LocalExecutor(tmp_path, gpus=["0", "1"])  # declared GPUs: nothing is started here
    apart = {"resources": {"colocate": False}}
    with pytest.raises(ConfigError, match="use weights.transport=broadcast, or resources.colocate=true"):
        place(build_config(apart), executor, kernel)
    plan = place(build_config({**apart, "weights": {"transport": "broadcast"}}), executor, kernel)
    assert [s.gpus for s in plan.trainer] == [("0",)] and [s.gpus for s in plan.engines] == [("1",)]
    shared = place(build_config({}), executor, kernel)  # colocated (default): both on GPU 0
    assert [s.gpus for s in shared.trainer] == [("0",)] == [s.gpus for s in shared.engines]
    assert not place(build_config({"model": {"device": "cpu"}}), executor, kernel).uses_gpus
