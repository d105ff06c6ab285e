"""Every hook a Miles plugin can implement.

Three shapes, each chosen for what the hook decides:

* **register-by-name** -- ``miles_register_<kind>(register)``: the plugin calls
  ``register(name, spec)`` once per implementation, with the kind's frozen spec from
  :mod:`miles_contracts.specs` (``GeneratorSpec``, ``AdvantageSpec`` ...): the implementation and
  every capability the kernel reads, as typed fields. Config picks implementations by name; an
  unknown name fails at start-up listing every registered name and its distribution. Used for
  everything a user *chooses*: generators, rewards, filters, advantages, backends, engines,
  transports, executors, trackers, data sources, tools, agents, router middleware, chat families,
  commands and config sections. Installing a package therefore never changes a run by itself.
  Factories receive the :class:`~miles_contracts.RunContext` of the process they run in.
* **claim** (``firstresult``, returns ``X | None``): the first plugin that recognises the input
  answers; used where the *input* decides (``miles_model_bridge``: which model family is this?).
* **pipeline / wrapper**: filters and router middleware are registered by name and composed in
  config order (all filters must keep a group; middleware wrap each other outermost-first);
  ``miles_forward`` is a pluggy wrapper hook around every forward pass of a train backend, so a
  plugin (routing replay) can act inside a backend without the backend knowing it.
  Lifecycle hooks (``miles_run_start`` ...) are broadcasts: every implementation is called;
  so is ``miles_engine_captures``, where each plugin answers for its own config section.

Every spec says **where it runs**: a run is a driver, trainer ranks and services, each its own
process (docs/design/process-model.md), and a hook is called in the processes its docstring names
(each of them loads the plugins of the run's ``plugins`` section).

Arguments are passed by keyword; an implementation may accept fewer arguments than its spec
(pluggy's opt-in arguments), so specs can grow without breaking plugins. Types named here come from
``miles_contracts`` and are imported only for type checking.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from collections.abc import Generator, Mapping, Sequence
    from pathlib import Path

    from miles_contracts import EngineCapture, ForwardContext, ModelBridge, RunContext, specs
    from miles_contracts.chat import ChatFamily

    from miles.config import MilesConfig
    from miles.registry import Register

PROJECT = "miles"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# =============================================================================== rollout


@hookspec
def miles_register_generators(register: Register[specs.GeneratorSpec]) -> None:
    """Register rollout generators by name (``rollout.generator`` picks one).

    **Runs in** the driver (generators run there, on its event loop).

    A :class:`~miles_contracts.GeneratorSpec` holds the async ``(sample, ctx: GenerateContext) ->
    Sample`` (:class:`miles_contracts.Generator`), the service roles a run using it must start
    (``services=("session",)``) and whether it needs ``rollout.agent`` (``needs_agent``).
    Built-ins: ``single_turn`` (kernel), ``multi_turn`` and ``agentic`` (miles-tito).

    :param register: ``register(name, GeneratorSpec(...))``.
    """


@hookspec
def miles_register_tools(register: Register[specs.ToolSpec]) -> None:
    """Register tools the ``multi_turn`` generator can offer the model (``rollout.tools``).

    **Runs in** the driver (tools are called there, by the generator).

    A :class:`~miles_contracts.ToolSpec` holds a :class:`miles_contracts.Tool` (name, description,
    JSON-schema parameters, async call returning the tool message text).

    :param register: ``register(name, ToolSpec(tool))``.
    """


@hookspec
def miles_register_agents(register: Register[specs.AgentSpec]) -> None:
    """Register agents the ``agentic`` generator can run (``rollout.agent``).

    **Runs in** the driver (agents run there, on its event loop, against the session server).

    An :class:`~miles_contracts.AgentSpec` holds ``async def run_agent(base_url, prompt,
    request_kwargs, metadata) -> dict | None`` that talks to ``base_url`` with any
    OpenAI-compatible client.

    :param register: ``register(name, AgentSpec(run_agent))``.
    """


@hookspec
def miles_engine_captures(config: MilesConfig, ctx: RunContext) -> Sequence[EngineCapture]:
    """Say what per-position data every engine call of this run's rollouts must return.

    **Runs in** the driver, once, when the rollout starts; every implementation is called and the
    captures are concatenated. Return an empty list unless the run's config asks for your feature (installing a
    package must not change a run). The generators add each capture's request fields to every
    generate request (session servers receive the specs when a session is created), keep each
    answer's payload, and store the stitched data in the sample's stash under ``capture.key``; a
    sample whose data is missing is marked FAILED (exit reason ``missing_capture``). Evaluation
    rollouts carry no captures. See :mod:`miles_contracts.capture`.

    :param config: the validated config.
    :param ctx: the driver's run context (its kernel finds the model's bridge).
    :returns: :class:`miles_contracts.EngineCapture` objects (names unique across plugins).
    """


@hookspec
def miles_register_data_sources(register: Register[specs.DataSourceSpec]) -> None:
    """Register prompt sources (``data.source``): file readers and task generators.

    **Runs in** the driver (sources are opened and drawn from there).

    A :class:`~miles_contracts.DataSourceSpec` holds ``open(ctx, data_section) -> DataSource``.

    :param register: ``register(name, DataSourceSpec(open))``.
    """


# =============================================================================== scoring


@hookspec
def miles_register_rewards(register: Register[specs.RewardSpec]) -> None:
    """Register reward functions (``reward.name``, or per sample ``metadata["reward"]``).

    **Runs in** the driver (rewards score finished groups there; a reward may hand work to its
    own processes, as ``math`` does).

    A :class:`~miles_contracts.RewardSpec` holds a sync or async ``(samples: Sequence[Sample]) ->
    list[float]``: batch in, one float per sample out (TRL-style plain functions work). Return NaN
    for a sample that cannot be scored.

    :param register: ``register(name, RewardSpec(reward_fn))``.
    """


@hookspec
def miles_register_filters(register: Register[specs.FilterSpec]) -> None:
    """Register group filters (``rollout.filters`` lists the pipeline, in order; all must keep).

    **Runs in** the driver.

    A :class:`~miles_contracts.FilterSpec` holds ``(group: Sequence[Sample]) -> FilterVerdict``; a
    dropped group's ``reason`` is counted in the metrics as ``filter/drop_<reason>``.

    :param register: ``register(name, FilterSpec(filter_fn))``.
    """


@hookspec
def miles_register_advantages(register: Register[specs.AdvantageSpec]) -> None:
    """Register advantage estimators (``algorithm.advantage``).

    **Runs in** the driver (advantages are computed there, between rewards and the train step).

    An :class:`~miles_contracts.AdvantageSpec` holds the estimator
    (:class:`miles_contracts.AdvantageEstimator`: ``(batch: TrainBatch, params: AlgorithmParams)
    -> AdvantageResult``) and what it declares: ``needs_critic``, ``zero_sum_groups`` (the
    conformance suite ``miles_contracts.testing.advantage`` then checks that a prompt group's
    advantages sum to zero) and ``policy_loss`` (the loss it is meant for, e.g. ``gspo``). The
    estimator computes its own method only: the kernel then zeroes off-mask positions, whitens
    (``algorithm.normalize_advantages``) and adds on-policy distillation (``algorithm.opd_coef``)
    for every estimator alike (:mod:`miles.training.advantages`).

    :param register: ``register(name, AdvantageSpec(estimator, ...))``.
    """


@hookspec
def miles_register_policy_losses(register: Register[specs.PolicyLossSpec]) -> None:
    """Register policy losses (``train.policy_loss``; default ``ppo_clip``).

    **Runs in** every trainer rank (inside the backend's train step).

    A :class:`~miles_contracts.PolicyLossSpec` holds ``(logprobs [B, T], batch, params) -> (per_token_loss [B, T], token_metrics)``:
    the loss is 0 off-mask; ``token_metrics`` maps names to ``[B, T]`` per-token values (e.g.
    ``pg_clipfrac``: 1.0 where the clip was active) that are averaged over trainable tokens.
    ``batch.old_logprobs`` is always set when it is called (the detached current log-probs when
    the backend skipped the old-policy pass, the rollout's with ``train.reuse_rollout_logprobs``). ``miles_algorithms.objective.actor_loss`` applies
    the mismatch correction, the entropy and KL terms and the loss reduction.

    :param register: ``register(name, PolicyLossSpec(loss_fn))``.
    """


@hookspec
def miles_register_mismatch_corrections(register: Register[specs.CorrectionSpec]) -> None:
    """Register train/rollout mismatch corrections (``algorithm.correction``: none, tis, mis).

    **Runs in** every trainer rank (inside the backend's train step).

    A :class:`~miles_contracts.CorrectionSpec` holds ``(proximal_logprobs, rollout_logprobs, loss_mask, params) -> (weights [B, T],
    token_metrics)``; weights are detached and 0 off-mask, and multiply the per-token policy loss
    (0 masks a token out); ``token_metrics`` as for policy losses. ``proximal_logprobs`` are the
    trainer's old-policy log-probs (or the detached current ones when there was no old pass).

    :param register: ``register(name, CorrectionSpec(correction_fn))``.
    """


# =============================================================================== models


@hookspec(firstresult=True)
def miles_model_bridge(hf_config: Mapping[str, Any]) -> ModelBridge | None:
    """Claim a model: return a bridge if this plugin knows the architecture, else None.

    **Runs in** every process that needs model-family knowledge: trainer ranks (weights, megatron
    config), the driver (routing replay's layer map), the session server (its chat family).

    Stops at the first non-None result. Model plugins (``miles-model-llama``, ...) implement it by
    inspecting ``hf_config["architectures"]`` / ``hf_config["model_type"]``.

    :param hf_config: the model's ``config.json`` as a mapping.
    :returns: a :class:`miles_contracts.ModelBridge`, or None when not recognised.
    """


@hookspec(firstresult=True)
def miles_resolve_model(name: str) -> Path | None:
    """Claim a model name: return the local Hugging Face folder for ``name``, or None.

    **Runs in** every process that loads the model by name: the driver (tokenizer), trainer ranks,
    engines and the session server.

    Stops at the first non-None result. Called for ``model.name`` values that are not a local
    folder; ``miles-models`` implements it for the models it can fetch (pulling on first use).

    :param name: the configured model name.
    :returns: a folder holding ``config.json``, weights and tokenizer, or None if unknown here.
    """


@hookspec
def miles_model_names() -> Sequence[str]:
    """List the model names this plugin's :func:`miles_resolve_model` resolves.

    **Runs in** the process whose model name no plugin resolved (``miles train`` checks
    ``model.name`` before it makes the run folder): the error suggests the closest of these names.

    Every implementation is called; the lists are joined. A resolver of open-ended names (hub
    ids, say) lists the ones worth suggesting.

    :returns: model names, e.g. ``["smollm2-135m-instruct"]``.
    """


@hookspec
def miles_register_chat_families(register: Register[ChatFamily]) -> None:
    """Register chat-template families for token-in-token-out sessions (``tito.family``).

    **Runs in** the session server and the driver (the ``multi_turn`` generator).

    A :class:`miles_contracts.chat.ChatFamily` (frozen data, registered as it is) carries the
    fixed template, allowed appended roles, splice rules, and tool-call / reasoning parsers. Model
    plugins register theirs; a bridge names its default family in ``bridge.chat_family``.

    :param register: ``register(name, family)``.
    """


# =============================================================================== training


@hookspec
def miles_register_train_backends(register: Register[specs.TrainBackendSpec]) -> None:
    """Register training backends (``train.backend``: fsdp, megatron).

    **Runs in** every trainer rank (``create``) and the driver (the spec's capabilities are read
    when the layout is planned).

    A :class:`~miles_contracts.TrainBackendSpec` holds ``create(ctx) -> TrainBackend`` and
    ``weights_on_rank0`` (``named_weights()`` yields the full weights on trainer rank 0 only: the
    kernel then refuses layouts in which another rank would push weights).

    :param register: ``register(name, TrainBackendSpec(create, ...))``.
    """


@hookspec
def miles_train_step_end(metrics: dict[str, float]) -> None:
    """Called after each ``train_step`` of the backend.

    **Runs in** every trainer rank.

    The place for plugins that measure inside the backend (a ``miles_forward`` wrapper) to report:
    add namespaced entries (``"r3/train/routing_agreement"``) to ``metrics``. Trainer ranks are
    processes of their own, so a driver-side hook (``miles_step_end``) cannot see such counters.
    Rank 0's metrics are the step's; a plugin that needs all ranks reduces over them itself.

    :param metrics: the backend's metrics of this train step; mutable. Names with a ``/`` keep
        their namespace in the step's metrics, the backend's own get ``train/``.
    """


@hookspec(firstresult=True)
def miles_forward(ctx: ForwardContext) -> Generator[None, Any, Any]:
    """Wrap every forward pass a train backend runs (log-prob passes and training).

    **Runs in** every trainer rank.

    Implementations must be wrappers, ``@hookimpl(wrapper=True)`` generators (the kernel refuses
    plain implementations): prepare before ``yield`` (e.g. install module hooks on ``ctx.model``),
    receive the forward's result from the ``yield``, clean up, and return the result (or a
    replacement). Backends call it through :meth:`miles.kernel.Kernel.run_forward`, which runs the
    real forward innermost. Wrappers run for every backend; a wrapper returns the result unchanged
    when ``ctx`` is not for it.

    :param ctx: phase, model, batch, backend name and model bridge of this forward.
    """


@hookspec
def miles_register_weight_transports(register: Register[specs.WeightTransportSpec]) -> None:
    """Register weight transports (``weights.transport``: disk, shared_memory, broadcast).

    **Runs in** the trainer ranks that push weights (``create``) and the driver (the spec's
    capabilities are read when the layout is planned).

    A :class:`~miles_contracts.WeightTransportSpec` holds ``create(ctx) -> WeightTransport`` and
    ``needs_shared_gpu`` (engines open the trainer's GPU memory: a disaggregated layout is refused).

    :param register: ``register(name, WeightTransportSpec(create, ...))``.
    """


# =============================================================================== inference


@hookspec
def miles_register_services(register: Register[specs.ServiceSpec]) -> None:
    """Register long-running servers a run can start: inference engines, the router, the session
    server (``rollout.engine`` picks the engine; the run starts a router and what its generator's
    spec lists in ``services``).

    **Runs in** the driver (which plans the services and builds their command lines); each service
    then runs in its own process, started from the run's config file (``launch.config_path``).

    A :class:`~miles_contracts.ServiceSpec` holds its ``role`` (``engine``, ``router``, ``session``
    ...), ``command(launch) -> argv`` of a process serving it on ``launch.endpoint``, the roles it
    ``needs`` URLs of, its ``health_path``, the ``config_sections`` it reads, and optionally
    ``upstream_moved`` (follow an upstream that moved instead of being restarted). Every executor
    starts every service the same way (placement, GPUs, logs, restarts); an engine gets the GPUs
    ``resources`` gives it through ``CUDA_VISIBLE_DEVICES``.

    :param register: ``register(name, ServiceSpec(role, command, ...))``.
    """


@hookspec
def miles_register_router_middlewares(register: Register[specs.RouterMiddlewareSpec]) -> None:
    """Register router middleware (``router.middlewares`` lists the chain, outermost first).

    **Runs in** the router process (loaded with the run's plugin selection from its config).

    A :class:`~miles_contracts.RouterMiddlewareSpec` holds ``create(ctx, options) ->
    RouterMiddleware``; ``options`` is the middleware's entry of ``router.middleware_options``.

    :param register: ``register(name, RouterMiddlewareSpec(create))``.
    """


# =============================================================================== orchestration


@hookspec
def miles_register_executors(register: Register[specs.ExecutorSpec]) -> None:
    """Register executors (``executor.name``: local, ray).

    **Runs in** the driver (the executor starts and supervises every other process).

    An :class:`~miles_contracts.ExecutorSpec` holds ``create(ctx) -> Executor``
    (:class:`miles_contracts.Executor`; conformance suite ``miles_contracts.testing.executor``).

    :param register: ``register(name, ExecutorSpec(create))``.
    """


@hookspec
def miles_register_trackers(register: Register[specs.TrackerSpec]) -> None:
    """Register metric trackers (``tracking.trackers`` lists those to use; jsonl always runs).

    **Runs in** the driver.

    A :class:`~miles_contracts.TrackerSpec` holds ``create(ctx) -> Tracker``.

    :param register: ``register(name, TrackerSpec(create))``.
    """


# =============================================================================== config and CLI


@hookspec
def miles_register_config_sections(register: Register[specs.ConfigSectionSpec]) -> None:
    """Contribute top-level config sections, each validated by the plugin's own pydantic model.

    **Runs in** every process that loads a config: the driver, trainer ranks, services, CLI
    commands that read a config.

    A section is rejected as unknown unless a loaded plugin registered it. Models should forbid
    extra keys (subclass :class:`miles.sections.Section`) so typos are errors.

    :param register: ``register(section_name, ConfigSectionSpec(PydanticModel))``.
    """


@hookspec
def miles_register_commands(register: Register[specs.CommandSpec]) -> None:
    """Contribute ``miles`` CLI commands.

    **Runs in** the CLI process (``miles ...``), before arguments are parsed.

    A :class:`~miles_contracts.CommandSpec` holds the help line, ``run(args, ctx)`` and
    ``add_arguments(parser)``; a name with a space (``"serve engine"``) becomes a sub-command of a
    group (``miles serve engine``).

    :param register: ``register(name, CommandSpec(...))``.
    """


# =============================================================================== lifecycle


@hookspec(historic=True)
def miles_configure(config: MilesConfig, ctx: RunContext) -> None:
    """Called once a process of a run has loaded the run's config, before it starts anything.

    **Runs in** every process of a run: the driver, each trainer rank, and each service started
    from the run's config (``ctx.process`` says which). Raise :class:`miles.errors.ConfigError`
    for a combination of settings your plugin cannot serve.

    Historic: a plugin registered later still receives the call.

    :param config: the validated config.
    :param ctx: this process's run context.
    """


@hookspec
def miles_run_start(config: MilesConfig, run_dir: Path) -> None:
    """Called when ``miles train`` has started every component, before the first step.

    **Runs in** the driver.

    :param config: the validated config.
    :param run_dir: the run's output folder (``runs/<name>``).
    """


@hookspec
def miles_step_end(step: int, metrics: dict[str, float]) -> None:
    """Called after each RL step, before metrics are logged.

    **Runs in** the driver (trainer-side counters: ``miles_train_step_end``).

    Implementations may add entries to ``metrics`` (they are logged with the step's own).

    :param step: the step just finished (1-based).
    :param metrics: the step's metrics; mutable.
    """


@hookspec
def miles_weights_synced(version: int) -> None:
    """Called after every engine received weights of ``version``.

    **Runs in** the driver.

    :param version: the new engine weight version.
    """


@hookspec
def miles_run_end(run_dir: Path, status: str) -> None:
    """Called when a run ends (``completed``, ``failed`` or ``interrupted``), after cleanup.

    **Runs in** the driver.

    :param run_dir: the run's output folder.
    :param status: how the run ended.
    """
