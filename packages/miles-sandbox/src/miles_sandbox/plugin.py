"""Plugin ``sandbox``: the ``sandbox`` service and config section, ``miles serve sandbox``,
``miles bench sandbox``, the ``mini_swe_agent`` agent (extra ``swe``) and the ``swe_tests`` reward.
Light on purpose: FastAPI, httpx and mini-swe-agent load only where they run (the service process;
the driver, for the agent)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from miles import hookimpl
from miles.registry import Register
from miles_contracts import (
    AgentSpec,
    CommandSpec,
    ConfigSectionSpec,
    RewardSpec,
    RunContext,
    Sample,
    ServiceSpec,
)

from miles_sandbox.config import SandboxSection


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    from miles_sandbox.server import add_arguments

    add_arguments(parser)


def _serve(args: argparse.Namespace, ctx: RunContext) -> int:
    from miles_sandbox.server import run

    return run(args)


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    from miles_sandbox.bench import add_arguments

    add_arguments(parser)


def _bench(args: argparse.Namespace, ctx: RunContext) -> int:
    from miles_sandbox.bench import run

    return run(args)


async def _unbound_agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]) -> Any:
    raise RuntimeError("mini_swe_agent runs bound to its run (AgentSpec.bind)")


def _bind_agent(ctx: RunContext) -> Any:
    # in the driver, per episode (the agentic generator binds the agent for each sample)
    from miles_sandbox.swe.agent import bind

    return bind(ctx)


def _swe_tests(samples: Sequence[Sample]) -> list[float]:
    from miles_sandbox.swe.reward import tests_passed_share

    return [tests_passed_share(sample) for sample in samples]


@hookimpl
def miles_register_commands(register: Register[CommandSpec]) -> None:
    register("serve sandbox", CommandSpec(
        "Sandboxed command execution for agents (bubblewrap): warm pool, workspaces from templates",
        _serve, add_arguments=_serve_arguments,
        description="Serve the sandbox service (the run's `sandbox` section of --config) on loopback.",
    ))
    register("bench sandbox", CommandSpec(
        "Tool calls/s and p50/p99 latency in 1/16/64 concurrent sandboxes vs subprocess; warm vs cold start",
        _bench, add_arguments=_bench_arguments,
        description="Start the sandbox service, run a trivial command through it at several concurrencies and "
                    "directly with subprocess (the baseline), and print JSON with the ratios.",
    ))


@hookimpl
def miles_register_services(register: Register[ServiceSpec]) -> None:
    from miles_sandbox.service import SANDBOX_SERVICE

    register("sandbox", SANDBOX_SERVICE)


@hookimpl
def miles_register_config_sections(register: Register[ConfigSectionSpec]) -> None:
    register("sandbox", ConfigSectionSpec(SandboxSection))


@hookimpl
def miles_register_agents(register: Register[AgentSpec]) -> None:
    from miles_sandbox.swe.settings import SweAgentSettings

    register("mini_swe_agent", AgentSpec(_unbound_agent, bind=_bind_agent, settings_model=SweAgentSettings,
                                         services=("sandbox",)))


@hookimpl
def miles_register_rewards(register: Register[RewardSpec]) -> None:
    register("swe_tests", RewardSpec(_swe_tests))
