"""Plugin ``longtail`` (distribution miles-longtail): the ``long_tail`` agent, the ``repeated_tokens``
reward, the ``longtail`` config section and the ``bench async`` command.

The agent a run runs is bound to the run's ``longtail`` section (``AgentSpec.bind``, in the
driver); the benchmark command loads lazily.
"""

from __future__ import annotations

import argparse

from miles import hookimpl
from miles.registry import Register
from miles_contracts import AgentSpec, CommandSpec, ConfigSectionSpec, RewardSpec, RunContext

from miles_longtail.agent import LongTailAgent, repeated_tokens
from miles_longtail.workload import LongTailSection


def _for_run(ctx: RunContext) -> LongTailAgent:
    """The agent of this run: its ``longtail`` section's workload."""
    return LongTailAgent(ctx.config.section("longtail", LongTailSection))


@hookimpl
def miles_register_agents(register: Register[AgentSpec]) -> None:
    register("long_tail", AgentSpec(LongTailAgent(), bind=_for_run))


@hookimpl
def miles_register_rewards(register: Register[RewardSpec]) -> None:
    register("repeated_tokens", RewardSpec(repeated_tokens))


@hookimpl
def miles_register_config_sections(register: Register[ConfigSectionSpec]) -> None:
    register("longtail", ConfigSectionSpec(LongTailSection))


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    from miles_longtail.bench import add_arguments

    add_arguments(parser)


def _run(args: argparse.Namespace, ctx: RunContext) -> int:
    from miles_longtail.bench import run

    return run(args)


@hookimpl
def miles_register_commands(register: Register[CommandSpec]) -> None:
    register("bench async", CommandSpec(
        "sync vs one_step_off vs fully_async on a long-tail agentic workload: time to N steps, samples/s, rewards",
        _run, add_arguments=_add_arguments,
        description="Trains the same run (prompts, seeds, episodes) in each loop mode and reports each mode's speedup "
                    "over sync measured in the same invocation; --png plots the reward curves side by side.",
    ))
