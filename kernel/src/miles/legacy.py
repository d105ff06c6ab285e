"""Adapters for plugins written before specs (Miles 0.1): a bare object registered where a spec is
expected becomes that spec, for one release.

Before specs, a plugin registered the implementation itself and declared capabilities as
attributes on it (``create_backend.weights_on_rank0 = True``, an estimator class's
``needs_critic``, a generator's ``services``); factories took the config (and the run folder)
instead of a :class:`~miles_contracts.RunContext`. Each function here reads exactly the attributes
that kind's hook documented and builds the spec, so an old plugin behaves as before. The kernel
warns (:class:`~miles.errors.MilesDeprecationWarning`) naming the spec to register instead. This
module is the only place that reads capabilities off registered objects; it goes away in 0.3.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from miles_contracts import specs
from miles_contracts.context import RunContext


def _declared(obj: object, name: str, default: Any) -> Any:
    """A capability the pre-spec hook docs let a plugin declare as an attribute (class or instance)."""
    value = inspect.getattr_static(obj, name, default)
    if isinstance(value, (staticmethod, classmethod, property)):
        return default
    return value


def generator(obj: Any) -> specs.GeneratorSpec:
    return specs.GeneratorSpec(obj, services=tuple(_declared(obj, "services", ())))


def tool(obj: Any) -> specs.ToolSpec:
    return specs.ToolSpec(obj)


def agent(obj: Any) -> specs.AgentSpec:
    return specs.AgentSpec(obj)


def data_source(factory: Any) -> specs.DataSourceSpec:
    return specs.DataSourceSpec(lambda ctx, data: factory(data))


def reward(obj: Any) -> specs.RewardSpec:
    return specs.RewardSpec(obj)


def filter_(obj: Any) -> specs.FilterSpec:
    return specs.FilterSpec(obj)


def advantage(obj: Any) -> specs.AdvantageSpec:
    return specs.AdvantageSpec(obj, needs_critic=bool(_declared(obj, "needs_critic", False)),
                         zero_sum_groups=bool(_declared(obj, "zero_sum_groups", False)),
                         policy_loss=_declared(obj, "policy_loss", None))


def policy_loss(obj: Any) -> specs.PolicyLossSpec:
    return specs.PolicyLossSpec(obj)


def correction(obj: Any) -> specs.CorrectionSpec:
    return specs.CorrectionSpec(obj)


def train_backend(factory: Any) -> specs.TrainBackendSpec:
    return specs.TrainBackendSpec(lambda ctx: factory(ctx.config),
                            weights_on_rank0=bool(_declared(factory, "weights_on_rank0", False)))


def weight_transport(factory: Any) -> specs.WeightTransportSpec:
    return specs.WeightTransportSpec(lambda ctx: factory(ctx.config),
                               needs_shared_gpu=bool(_declared(factory, "needs_shared_gpu", False)))


def service(obj: Any) -> specs.ServiceSpec:
    moved = _declared(obj, "upstream_moved", None)
    return specs.ServiceSpec(
        obj.role, obj.command, needs=tuple(obj.needs), health_path=obj.health_path,
        config_sections=tuple(obj.config_sections), upstream_moved=obj.upstream_moved if moved is not None else None,
    )


def router_middleware(factory: Any) -> specs.RouterMiddlewareSpec:
    return specs.RouterMiddlewareSpec(lambda ctx, options: factory(dict(options)))


def _run_dir(ctx: RunContext) -> Any:
    return ctx.require_run_dir("a pre-spec executor or tracker factory (config, run_dir)")


def executor(factory: Any) -> specs.ExecutorSpec:
    return specs.ExecutorSpec(lambda ctx: factory(ctx.config, _run_dir(ctx)))


def tracker(factory: Any) -> specs.TrackerSpec:
    return specs.TrackerSpec(lambda ctx: factory(ctx.config, _run_dir(ctx)))


def config_section(model: Any) -> specs.ConfigSectionSpec:
    return specs.ConfigSectionSpec(model)


def command(obj: Any) -> specs.CommandSpec:
    """A ``miles.cli.Command`` (whose ``run`` takes the arguments only)."""
    run = obj.run
    return specs.CommandSpec(obj.help, lambda args, ctx: run(args), add_arguments=obj.add_arguments,
                       description=obj.description)


LEGACY_ATTRIBUTES: Mapping[str, tuple[str, ...]] = {
    "generator": ("services",),
    "advantage": ("needs_critic", "zero_sum_groups", "policy_loss"),
    "train_backend": ("weights_on_rank0",),
    "weight_transport": ("needs_shared_gpu",),
    "service": ("role", "needs", "health_path", "config_sections", "upstream_moved"),
}
"""The attributes each adapter carries over (the deprecation warning lists them)."""
