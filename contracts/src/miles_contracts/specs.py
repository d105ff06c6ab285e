"""Specs: what a plugin registers, one frozen dataclass per registry kind.

A ``miles_register_<kind>(register)`` hook calls ``register(name, spec)``. The spec carries the
implementation (a callable or a factory) *and* every capability the kernel may need to know about
it, as typed fields: ``AdvantageSpec(estimator, needs_critic=True)``, never an attribute patched
onto a function. A field the kernel reads is declared here, so a type checker sees it, the
registry validates it when the plugin registers, and ``docs/plugins/hooks.md`` lists it.

Factories take the :class:`~miles_contracts.context.RunContext` of the process they run in (its
config, kernel, run folder and process kind): a plugin never loads a kernel of its own.

::

    @hookimpl
    def miles_register_train_backends(register: Register[TrainBackendSpec]) -> None:
        register("mine", TrainBackendSpec(create=lambda ctx: MyBackend(ctx), weights_on_rank0=True))

Chat families (:class:`miles_contracts.chat.ChatFamily`) are already plain frozen data and are
registered as they are.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any

from miles_contracts.cluster import ServiceLaunch
from miles_contracts.context import RunContext
from miles_contracts.protocols import (
    AdvantageEstimator,
    AgentFn,
    DataSource,
    Executor,
    Filter,
    Generator,
    RewardFn,
    RouterMiddleware,
    Tool,
    Tracker,
    TrainBackend,
    WeightTransport,
)

if TYPE_CHECKING:
    import torch
    from miles.sections import DataSection
    from pydantic import BaseModel

    from miles_contracts.algorithm import AlgorithmParams
    from miles_contracts.batch import TrainBatch

TokenMetrics = Mapping[str, "torch.Tensor"]
PolicyLossFn = Callable[["torch.Tensor", "TrainBatch", "AlgorithmParams"], tuple["torch.Tensor", TokenMetrics]]
"""``(logprobs [B, T], batch, params) -> (per_token_loss [B, T], token_metrics)``."""
CorrectionFn = Callable[
    ["torch.Tensor", "torch.Tensor", "torch.Tensor", "AlgorithmParams"], tuple["torch.Tensor", TokenMetrics]
]
"""``(proximal_logprobs, rollout_logprobs, loss_mask, params) -> (weights [B, T], token_metrics)``."""


def _check_callable(owner: object, **fields: object) -> None:
    for name, value in fields.items():
        if not callable(value):
            raise TypeError(f"{type(owner).__name__}.{name} must be callable, got {type(value).__name__} {value!r}")


def _check_names(owner: object, name: str, values: Sequence[str]) -> None:
    if isinstance(values, str) or not all(isinstance(v, str) and v for v in values):
        raise TypeError(f"{type(owner).__name__}.{name} must be a tuple of non-empty names, got {values!r}")


def _check_model(owner: object, name: str, model: object) -> None:
    from pydantic import BaseModel

    if model is not None and not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise TypeError(f"{type(owner).__name__}.{name} must be a pydantic model class or None, got {model!r}")


# ============================================================================ rollout


@dataclass(frozen=True, slots=True)
class GeneratorSpec:
    """A rollout generator (``rollout.generator``). Runs in the driver.

    :ivar generate: ``async (sample, ctx: GenerateContext) -> Sample``.
    :ivar services: roles of services every run using it must start, besides engines and the
        router (``("session",)``: the session server).
    :ivar needs_agent: ``rollout.agent`` must name a registered agent (checked with the config).
    """

    generate: Generator
    _: KW_ONLY
    services: tuple[str, ...] = ()
    needs_agent: bool = False

    def __post_init__(self) -> None:
        _check_callable(self, generate=self.generate)
        _check_names(self, "services", self.services)


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool the ``multi_turn`` generator offers the model (``rollout.tools``). Runs in the driver.

    :ivar tool: name, description, JSON-schema parameters, and ``async (**arguments) -> str``.
    """

    tool: Tool

    def __post_init__(self) -> None:
        _check_callable(self, tool=self.tool)
        for attribute in ("name", "description", "parameters"):
            if not hasattr(self.tool, attribute):
                raise TypeError(f"ToolSpec.tool must have a {attribute!r} (miles_contracts.Tool), got {self.tool!r}")


@dataclass(frozen=True, slots=True)
class AgentSpec:
    """An agent the ``agentic`` generator runs (``rollout.agent``). Runs in the driver.

    :ivar run: ``async run_agent(base_url, prompt, request_kwargs, metadata) -> dict | None``.
    :ivar bind: for an agent that reads the run's settings (a section of its own): ``(ctx) ->
        AgentFn``, the agent this run runs (called in the driver, with the driver's context).
    :ivar settings_model: the pydantic model of a data row's ``settings.agent`` (validated when the
        data source opens; the agent finds the result in ``metadata["settings"]["agent"]``). None:
        the agent takes no per-sample settings, and a row that sets some is refused.
    :ivar services: roles of services a run of this agent must start besides the generator's
        (``("sandbox",)``); their URLs reach the agent as ``metadata["services"][role]``.
    """

    run: AgentFn
    _: KW_ONLY
    bind: Callable[[RunContext], AgentFn] | None = None
    settings_model: type[BaseModel] | None = None
    services: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_callable(self, run=self.run)
        if self.bind is not None:
            _check_callable(self, bind=self.bind)
        _check_model(self, "settings_model", self.settings_model)
        _check_names(self, "services", self.services)


@dataclass(frozen=True, slots=True)
class DataSourceSpec:
    """A prompt source (``data.source``). Opened in the driver.

    :ivar open: ``(ctx, data_section) -> DataSource``; ``data_section`` is ``ctx.config.data`` for
        training, a copy pointing at ``data.eval_path`` for held-out prompts.
    """

    open: Callable[[RunContext, DataSection], DataSource]

    def __post_init__(self) -> None:
        _check_callable(self, open=self.open)


# ============================================================================ scoring


@dataclass(frozen=True, slots=True)
class RewardSpec:
    """A reward (``reward.name``, or per sample ``metadata["reward"]``). Runs in the driver.

    :ivar score: sync or async ``(samples) -> list[float]``, one float per sample (NaN: could not
        score it).
    :ivar bind: for a reward that reads the run's settings (``reward.timeout``, the ``remote``
        reward's URL, a section of its own): ``(ctx) -> RewardFn``, the reward this run scores with
        (called in the driver when a step's samples are scored).
    :ivar settings_model: the pydantic model of a data row's ``settings.reward``, the reward's
        per-sample parameters (validated when the data source opens; read them back with
        :func:`miles_contracts.settings.reward_settings`). None: the reward takes none, and a row
        that sets some is refused.
    """

    score: RewardFn
    _: KW_ONLY
    bind: Callable[[RunContext], RewardFn] | None = None
    settings_model: type[BaseModel] | None = None

    def __post_init__(self) -> None:
        _check_callable(self, score=self.score)
        if self.bind is not None:
            _check_callable(self, bind=self.bind)
        _check_model(self, "settings_model", self.settings_model)


@dataclass(frozen=True, slots=True)
class FilterSpec:
    """A group filter (``rollout.filters``). Runs in the driver.

    :ivar check: ``(group) -> FilterVerdict``.
    """

    check: Filter

    def __post_init__(self) -> None:
        _check_callable(self, check=self.check)


@dataclass(frozen=True, slots=True)
class AdvantageSpec:
    """An advantage estimator (``algorithm.advantage``). Runs in the driver.

    The estimator computes the advantages of its own method (group baselines, GAE, the KL reward
    penalty). Everything that applies to every estimator -- zeroing off-mask positions, batch
    whitening (``algorithm.normalize_advantages``), on-policy distillation (``algorithm.opd_coef``)
    -- is done once, by the kernel, after it: an estimator must not do it again.

    :ivar estimator: ``(batch: TrainBatch, params: AlgorithmParams) -> AdvantageResult``.
    :ivar needs_critic: the batch must carry critic values (``train.use_critic`` is required).
    :ivar zero_sum_groups: a prompt group's advantages sum to zero (before whitening); the
        conformance suite ``miles_contracts.testing.advantage`` then checks it.
    :ivar policy_loss: the policy loss the estimator is meant for (``gspo``), if it needs one:
        the config is refused with another.
    """

    estimator: AdvantageEstimator
    _: KW_ONLY
    needs_critic: bool = False
    zero_sum_groups: bool = False
    policy_loss: str | None = None

    def __post_init__(self) -> None:
        _check_callable(self, estimator=self.estimator)


@dataclass(frozen=True, slots=True)
class PolicyLossSpec:
    """A policy loss (``train.policy_loss``). Runs in every trainer rank.

    :ivar loss: ``(logprobs [B, T], batch, params) -> (per_token_loss [B, T], token_metrics)``.
    """

    loss: PolicyLossFn

    def __post_init__(self) -> None:
        _check_callable(self, loss=self.loss)


@dataclass(frozen=True, slots=True)
class CorrectionSpec:
    """A train/rollout mismatch correction (``algorithm.correction``). Runs in every trainer rank.

    :ivar correct: ``(proximal_logprobs, rollout_logprobs, loss_mask, params) -> (weights, token_metrics)``.
    """

    correct: CorrectionFn

    def __post_init__(self) -> None:
        _check_callable(self, correct=self.correct)


# ============================================================================ training and weights


@dataclass(frozen=True, slots=True)
class TrainBackendSpec:
    """A train backend (``train.backend``). ``create`` runs in every trainer rank; the driver
    reads the capabilities to plan the layout.

    :ivar create: ``(ctx) -> TrainBackend`` (SPMD: every rank builds one with the same config).
    :ivar weights_on_rank0: ``named_weights()`` yields the full weights on trainer rank 0 only;
        layouts in which another rank would push weights (colocated engines on other ranks'
        GPUs) are refused.
    """

    create: Callable[[RunContext], TrainBackend]
    _: KW_ONLY
    weights_on_rank0: bool = False

    def __post_init__(self) -> None:
        _check_callable(self, create=self.create)


@dataclass(frozen=True, slots=True)
class WeightTransportSpec:
    """A weight transport (``weights.transport``). ``create`` runs in the trainer ranks that push;
    the driver reads the capabilities to plan the layout.

    :ivar create: ``(ctx) -> WeightTransport``.
    :ivar needs_shared_gpu: engines open the trainer's GPU memory (CUDA IPC), so with GPUs each
        engine must sit on its pushing rank's GPU; a disaggregated layout is refused.
    """

    create: Callable[[RunContext], WeightTransport]
    _: KW_ONLY
    needs_shared_gpu: bool = False

    def __post_init__(self) -> None:
        _check_callable(self, create=self.create)


# ============================================================================ services and orchestration


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    """A long-running server a run can start: an engine, the router, the session server.

    The driver plans and starts it (``command`` runs in the driver, again on every restart); the
    service process itself reads the run's config from ``launch.config_path``.

    :ivar role: ``engine`` (chosen by ``rollout.engine``, placed by ``resources``), ``router``
        (always started, in front of the engines), or a role a generator's spec lists in
        ``services`` (``session``).
    :ivar command: ``(launch) -> argv`` of a process serving this instance on ``launch.endpoint``.
    :ivar needs: roles whose URLs it must be given (they are started before it).
    :ivar health_path: ``GET`` path that answers 200 once it serves (None: no health check).
    :ivar config_sections: the config sections it reads (listed in ``<run>/services.json``).
    :ivar upstream_moved: ``(url, role, old, new)``: tell the running instance at ``url`` that its
        ``role`` upstream moved from ``old`` to ``new`` (an engine restarted on another node).
        None: the kernel restarts the service instead.
    """

    role: str
    command: Callable[[ServiceLaunch], Sequence[str]]
    _: KW_ONLY
    needs: tuple[str, ...] = ()
    health_path: str | None = "/health"
    config_sections: tuple[str, ...] = ()
    upstream_moved: Callable[[str, str, str, str], None] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.role, str) or not self.role:
            raise TypeError(f"ServiceSpec.role must be a non-empty name, got {self.role!r}")
        _check_callable(self, command=self.command)
        _check_names(self, "needs", self.needs)
        _check_names(self, "config_sections", self.config_sections)
        if self.health_path is not None and not self.health_path.startswith("/"):
            raise ValueError(f"ServiceSpec.health_path must start with '/', got {self.health_path!r}")
        if self.upstream_moved is not None:
            _check_callable(self, upstream_moved=self.upstream_moved)


@dataclass(frozen=True, slots=True)
class RouterMiddlewareSpec:
    """A router middleware (``router.middlewares``). ``create`` runs in the router process.

    :ivar create: ``(ctx, options) -> RouterMiddleware``; ``options`` is the middleware's entry of
        ``router.middleware_options``. Raise ``ValueError`` for bad options (reported as config errors).
    :ivar reports: the middleware also is a :class:`~miles_contracts.protocols.MiddlewareReport`
        (``snapshot()``, ``prometheus()``): the router's ``/metrics`` includes what it reports.
    """

    create: Callable[[RunContext, Mapping[str, Any]], RouterMiddleware]
    _: KW_ONLY
    reports: bool = False

    def __post_init__(self) -> None:
        _check_callable(self, create=self.create)


@dataclass(frozen=True, slots=True)
class ExecutorSpec:
    """An executor (``executor.name``): starts and supervises the run's processes. Runs in the driver.

    :ivar create: ``(ctx) -> Executor``; ``ctx.run_dir`` is where process logs go.
    """

    create: Callable[[RunContext], Executor]

    def __post_init__(self) -> None:
        _check_callable(self, create=self.create)


@dataclass(frozen=True, slots=True)
class TrackerSpec:
    """A metrics tracker (``tracking.trackers``). Runs in the driver.

    :ivar create: ``(ctx) -> Tracker``.
    """

    create: Callable[[RunContext], Tracker]

    def __post_init__(self) -> None:
        _check_callable(self, create=self.create)


# ============================================================================ config and CLI


@dataclass(frozen=True, slots=True)
class ConfigSectionSpec:
    """A top-level config section, validated by the plugin's pydantic model in every process that
    loads the run's config (driver, trainer ranks, services). The model should forbid extra keys.

    :ivar model: the section's pydantic model.
    """

    model: type[BaseModel]

    def __post_init__(self) -> None:
        from pydantic import BaseModel

        if not (isinstance(self.model, type) and issubclass(self.model, BaseModel)):
            raise TypeError(f"ConfigSectionSpec.model must be a pydantic model class, got {self.model!r}")


@dataclass(frozen=True, slots=True)
class CommandSpec:
    """A ``miles`` CLI command; a name with a space (``"serve engine"``) is a sub-command. Runs in
    the CLI process.

    :ivar help: one line shown in ``miles --help``.
    :ivar run: ``(args, ctx) -> exit code`` (None means 0). ``ctx`` is a ``cli`` context whose config
        is the defaults; a command that reads a config file makes its own (``ctx.with_config``).
    :ivar add_arguments: adds the command's arguments to its parser.
    :ivar description: longer text for ``miles <command> --help``.
    """

    help: str
    run: Callable[[argparse.Namespace, RunContext], int | None]
    _: KW_ONLY
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    description: str | None = None

    def __post_init__(self) -> None:
        _check_callable(self, run=self.run)
        if self.add_arguments is not None:
            _check_callable(self, add_arguments=self.add_arguments)


__all__ = [
    "AdvantageSpec",
    "AgentSpec",
    "CommandSpec",
    "ConfigSectionSpec",
    "CorrectionFn",
    "CorrectionSpec",
    "DataSourceSpec",
    "ExecutorSpec",
    "FilterSpec",
    "GeneratorSpec",
    "PolicyLossFn",
    "PolicyLossSpec",
    "RewardSpec",
    "RouterMiddlewareSpec",
    "ServiceSpec",
    "ToolSpec",
    "TrackerSpec",
    "TrainBackendSpec",
    "WeightTransportSpec",
]
