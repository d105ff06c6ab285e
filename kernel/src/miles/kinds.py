"""The registry kinds: for each, its hook and its spec.

One row per ``miles_register_<kind>`` hook. :class:`~miles.kernel.Kernel` collects a kind's
registry from its hook the first time it is asked for, checks that every registered object is the
kind's spec, and adapts a bare object of the old style (a function with capability attributes)
through :mod:`miles.legacy`, with a :class:`~miles.errors.MilesDeprecationWarning`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from miles_contracts import specs
from miles_contracts.chat import ChatFamily

from miles import legacy

S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class Kind(Generic[S]):
    """One registry kind.

    :ivar name: the kind's key (``Choice("advantage")`` in config models refers to it).
    :ivar hook: the ``miles_register_<kind>`` hook that fills it.
    :ivar human: how messages name one entry (``advantage estimator``).
    :ivar spec: the type every entry must be.
    :ivar adapt: turns a bare object of the pre-spec style into the spec (kept for one release).
    """

    name: str
    hook: str
    human: str
    spec: type[S]
    adapt: Callable[[Any], S] | None = None


GENERATOR = Kind("generator", "miles_register_generators", "generator", specs.GeneratorSpec, legacy.generator)
TOOL = Kind("tool", "miles_register_tools", "tool", specs.ToolSpec, legacy.tool)
AGENT = Kind("agent", "miles_register_agents", "agent", specs.AgentSpec, legacy.agent)
DATA_SOURCE = Kind("data_source", "miles_register_data_sources", "data source", specs.DataSourceSpec, legacy.data_source)
REWARD = Kind("reward", "miles_register_rewards", "reward", specs.RewardSpec, legacy.reward)
FILTER = Kind("filter", "miles_register_filters", "filter", specs.FilterSpec, legacy.filter_)
ADVANTAGE = Kind("advantage", "miles_register_advantages", "advantage estimator", specs.AdvantageSpec, legacy.advantage)
POLICY_LOSS = Kind("policy_loss", "miles_register_policy_losses", "policy loss", specs.PolicyLossSpec, legacy.policy_loss)
MISMATCH_CORRECTION = Kind("mismatch_correction", "miles_register_mismatch_corrections", "mismatch correction",
                           specs.CorrectionSpec, legacy.correction)
CHAT_FAMILY = Kind("chat_family", "miles_register_chat_families", "chat family", ChatFamily, None)
TRAIN_BACKEND = Kind("train_backend", "miles_register_train_backends", "train backend", specs.TrainBackendSpec,
                     legacy.train_backend)
WEIGHT_TRANSPORT = Kind("weight_transport", "miles_register_weight_transports", "weight transport",
                        specs.WeightTransportSpec, legacy.weight_transport)
SERVICE = Kind("service", "miles_register_services", "service", specs.ServiceSpec, legacy.service)
ROUTER_MIDDLEWARE = Kind("router_middleware", "miles_register_router_middlewares", "router middleware",
                         specs.RouterMiddlewareSpec, legacy.router_middleware)
EXECUTOR = Kind("executor", "miles_register_executors", "executor", specs.ExecutorSpec, legacy.executor)
TRACKER = Kind("tracker", "miles_register_trackers", "tracker", specs.TrackerSpec, legacy.tracker)
CONFIG_SECTION = Kind("config_section", "miles_register_config_sections", "config section", specs.ConfigSectionSpec,
                      legacy.config_section)
COMMAND = Kind("command", "miles_register_commands", "command", specs.CommandSpec, legacy.command)

KINDS: dict[str, Kind[Any]] = {kind.name: kind for kind in (
    GENERATOR, TOOL, AGENT, DATA_SOURCE, REWARD, FILTER, ADVANTAGE, POLICY_LOSS, MISMATCH_CORRECTION,
    CHAT_FAMILY, TRAIN_BACKEND, WEIGHT_TRANSPORT, SERVICE, ROUTER_MIDDLEWARE, EXECUTOR, TRACKER,
    CONFIG_SECTION, COMMAND,
)}
"""Every kind by name, in the order ``docs/plugins/hooks.md`` lists them."""
