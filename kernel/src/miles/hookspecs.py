"""Every hook a Miles plugin can implement.

Three shapes, each chosen for what the hook decides:

* **register-by-name** -- ``miles_register_<kind>(register)``: the plugin calls
  ``register(name, obj)`` once per implementation. Config picks implementations by name; an unknown
  name fails at start-up listing every registered name and its distribution. Used for everything a
  user *chooses*: generators, rewards, filters, advantages, backends, engines, transports,
  executors, trackers, data sources, tools, agents, router middleware, chat families, commands and
  config sections. Installing a package therefore never changes a run by itself.
* **claim** (``firstresult``, returns ``X | None``): the first plugin that recognises the input
  answers; used where the *input* decides (``miles_model_bridge``: which model family is this?).
* **pipeline / wrapper**: filters and router middleware are registered by name and composed in
  config order (all filters must keep a group; middleware wrap each other outermost-first);
  ``miles_forward`` is a pluggy wrapper hook around every forward pass of a train backend, so a
  plugin (routing replay) can act inside a backend without the backend knowing it.
  Lifecycle hooks (``miles_run_start`` ...) are broadcasts: every implementation is called;
  so is ``miles_engine_captures``, where each plugin answers for its own config section.

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

    from miles_contracts import EngineCapture, ForwardContext, ModelBridge

    from miles.config import MilesConfig
    from miles.registry import Register

PROJECT = "miles"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# =============================================================================== rollout


@hookspec
def miles_register_generators(register: Register) -> None:
    """Register rollout generators by name (``rollout.generator`` picks one).

    A generator is an async callable ``(sample, ctx: GenerateContext) -> Sample`` satisfying
    :class:`miles_contracts.Generator`. Built-ins: ``single_turn`` (kernel), ``multi_turn`` and
    ``agentic`` (miles-tito).

    :param register: ``register(name, generator)``.
    """


@hookspec
def miles_register_tools(register: Register) -> None:
    """Register tools the ``multi_turn`` generator can offer the model (``rollout.tools``).

    A tool satisfies :class:`miles_contracts.Tool` (name, description, JSON-schema parameters,
    async call returning the tool message text).

    :param register: ``register(name, tool)``.
    """


@hookspec
def miles_register_agents(register: Register) -> None:
    """Register agents the ``agentic`` generator can run (``rollout.agent``).

    An agent is ``async def run_agent(base_url, prompt, request_kwargs, metadata) -> dict | None``
    that talks to ``base_url`` with any OpenAI-compatible client.

    :param register: ``register(name, run_agent)``.
    """


@hookspec
def miles_engine_captures(config: MilesConfig) -> Sequence[EngineCapture]:
    """Say what per-position data every engine call of this run's rollouts must return.

    Called once when the rollout starts; every implementation is called and the captures are
    concatenated. Return an empty list unless the run's config asks for your feature (installing a
    package must not change a run). The generators add each capture's request fields to every
    generate request (session servers receive the specs when a session is created), keep each
    answer's payload, and store the stitched data in the sample's stash under ``capture.key``; a
    sample whose data is missing is marked FAILED (exit reason ``missing_capture``). Evaluation
    rollouts carry no captures. See :mod:`miles_contracts.capture`.

    :param config: the validated config.
    :returns: :class:`miles_contracts.EngineCapture` objects (names unique across plugins).
    """


@hookspec
def miles_register_data_sources(register: Register) -> None:
    """Register prompt sources (``data.source``): file readers and task generators.

    The registered object is a factory ``(data_config: DataConfig) -> DataSource``.

    :param register: ``register(name, factory)``.
    """


# =============================================================================== scoring


@hookspec
def miles_register_rewards(register: Register) -> None:
    """Register reward functions (``reward.name``, or per sample ``metadata["reward"]``).

    A reward is sync or async ``(samples: Sequence[Sample]) -> list[float]``: batch in, one float
    per sample out (TRL-style plain functions work). Return NaN for a sample that cannot be scored.

    :param register: ``register(name, reward_fn)``.
    """


@hookspec
def miles_register_filters(register: Register) -> None:
    """Register group filters (``rollout.filters`` lists the pipeline, in order; all must keep).

    A filter is ``(group: Sequence[Sample]) -> FilterVerdict``; a dropped group's ``reason`` is
    counted in the metrics as ``filter/drop_<reason>``.

    :param register: ``register(name, filter_fn)``.
    """


@hookspec
def miles_register_advantages(register: Register) -> None:
    """Register advantage estimators (``algorithm.advantage``).

    An estimator satisfies :class:`miles_contracts.AdvantageEstimator`:
    ``(batch: TrainBatch, params: AlgorithmParams) -> AdvantageResult``, with a class attribute
    ``needs_critic``. Optional class attributes: ``zero_sum_groups`` (the conformance suite
    ``miles_contracts.testing.advantage`` then checks that a prompt group's advantages sum to
    zero) and ``policy_loss`` (the policy loss the estimator is meant for, e.g. ``gspo``).

    :param register: ``register(name, estimator)``.
    """


@hookspec
def miles_register_policy_losses(register: Register) -> None:
    """Register policy losses (``train.policy_loss``; default ``ppo_clip``).

    A policy loss is ``(logprobs [B, T], batch, params) -> (per_token_loss [B, T], token_metrics)``:
    the loss is 0 off-mask; ``token_metrics`` maps names to ``[B, T]`` per-token values (e.g.
    ``pg_clipfrac``: 1.0 where the clip was active) that are averaged over trainable tokens.
    ``batch.old_logprobs`` is always set when it is called (the detached current log-probs when
    the backend skipped the old-policy pass). ``miles_algorithms.objective.actor_loss`` applies
    the mismatch correction, the entropy and KL terms and the loss reduction.

    :param register: ``register(name, loss_fn)``.
    """


@hookspec
def miles_register_mismatch_corrections(register: Register) -> None:
    """Register train/rollout mismatch corrections (``algorithm.correction``: none, tis, mis).

    A correction is ``(proximal_logprobs, rollout_logprobs, loss_mask, params) -> (weights [B, T],
    token_metrics)``; weights are detached and 0 off-mask, and multiply the per-token policy loss
    (0 masks a token out); ``token_metrics`` as for policy losses. ``proximal_logprobs`` are the
    trainer's old-policy log-probs (or the detached current ones when there was no old pass).

    :param register: ``register(name, correction_fn)``.
    """


# =============================================================================== models


@hookspec(firstresult=True)
def miles_model_bridge(hf_config: Mapping[str, Any]) -> ModelBridge | None:
    """Claim a model: return a bridge if this plugin knows the architecture, else None.

    Stops at the first non-None result. Model plugins (``miles-model-llama``, ...) implement it by
    inspecting ``hf_config["architectures"]`` / ``hf_config["model_type"]``.

    :param hf_config: the model's ``config.json`` as a mapping.
    :returns: a :class:`miles_contracts.ModelBridge`, or None when not recognised.
    """


@hookspec(firstresult=True)
def miles_resolve_model(name: str) -> Path | None:
    """Claim a model name: return the local Hugging Face folder for ``name``, or None.

    Stops at the first non-None result. Called for ``model.name`` values that are not a local
    folder; ``miles-models`` implements it for the models it can fetch (pulling on first use).

    :param name: the configured model name.
    :returns: a folder holding ``config.json``, weights and tokenizer, or None if unknown here.
    """


@hookspec
def miles_register_chat_families(register: Register) -> None:
    """Register chat-template families for token-in-token-out sessions (``tito.family``).

    A family object (defined by miles-tito) carries the fixed template, allowed appended roles,
    splice rules, and tool-call / reasoning parsers. Model plugins register theirs; a bridge names
    its default family in ``bridge.chat_family``.

    :param register: ``register(name, family)``.
    """


# =============================================================================== training


@hookspec
def miles_register_train_backends(register: Register) -> None:
    """Register training backends (``train.backend``: fsdp, megatron).

    The registered object is a factory ``(config: MilesConfig) -> TrainBackend``. A factory whose
    backends yield the full weights from ``named_weights()`` on trainer rank 0 only says so with an
    attribute ``weights_on_rank0 = True``: the kernel then refuses layouts in which another rank
    would push weights (colocated engines on other ranks' GPUs).

    :param register: ``register(name, factory)``.
    """


@hookspec
def miles_train_step_end(metrics: dict[str, float]) -> None:
    """Called in every trainer rank process after each ``train_step`` of the backend.

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

    Implementations must be wrappers, ``@hookimpl(wrapper=True)`` generators (the kernel refuses
    plain implementations): prepare before ``yield`` (e.g. install module hooks on ``ctx.model``),
    receive the forward's result from the ``yield``, clean up, and return the result (or a
    replacement). Backends call it through :meth:`miles.kernel.Kernel.run_forward`, which runs the
    real forward innermost. Wrappers run for every backend; a wrapper returns the result unchanged
    when ``ctx`` is not for it.

    :param ctx: phase, model, batch, backend name and model bridge of this forward.
    """


@hookspec
def miles_register_weight_transports(register: Register) -> None:
    """Register weight transports (``weights.transport``: disk, shared_memory, broadcast).

    The registered object is a factory ``(config: MilesConfig) -> WeightTransport``.

    :param register: ``register(name, factory)``.
    """


# =============================================================================== inference


@hookspec
def miles_register_services(register: Register) -> None:
    """Register long-running servers a run can start: inference engines, the router, the session
    server (``rollout.engine`` picks the engine; the run starts a router and what its generator
    asks for).

    The registered object satisfies :class:`miles_contracts.Service`: its ``role`` (``engine``,
    ``router``, ``session`` ...), the roles it ``needs`` URLs of, its ``health_path``, the
    ``config_sections`` it reads, and ``command(launch)``, the argv of a process serving it on
    ``launch.endpoint``. Every executor starts every service the same way (placement, GPUs, logs,
    restarts); an engine gets the GPUs ``resources`` gives it through ``CUDA_VISIBLE_DEVICES``.

    :param register: ``register(name, service)``.
    """


@hookspec
def miles_register_router_middlewares(register: Register) -> None:
    """Register router middleware (``router.middlewares`` lists the chain, outermost first).

    The registered object is a factory ``(options: dict) -> RouterMiddleware``.

    :param register: ``register(name, factory)``.
    """


# =============================================================================== orchestration


@hookspec
def miles_register_executors(register: Register) -> None:
    """Register executors (``executor.name``: local, ray).

    The registered object is a factory ``(config: MilesConfig, run_dir: Path) -> Executor``.

    :param register: ``register(name, factory)``.
    """


@hookspec
def miles_register_trackers(register: Register) -> None:
    """Register metric trackers (``tracking.trackers`` lists those to use; jsonl always runs).

    The registered object is a factory ``(config: MilesConfig, run_dir: Path) -> Tracker``.

    :param register: ``register(name, factory)``.
    """


# =============================================================================== config and CLI


@hookspec
def miles_register_config_sections(register: Register) -> None:
    """Contribute top-level config sections, each validated by the plugin's own pydantic model.

    A section is rejected as unknown unless a loaded plugin registered it. Models should forbid
    extra keys (``model_config = ConfigDict(extra="forbid")``) so typos are errors.

    :param register: ``register(section_name, PydanticModel)``.
    """


@hookspec
def miles_register_commands(register: Register) -> None:
    """Contribute ``miles`` CLI commands.

    The registered object is a :class:`miles.cli.Command`; a name with a space (``"serve engine"``)
    becomes a sub-command of a group (``miles serve engine``).

    :param register: ``register(name, command)``.
    """


# =============================================================================== lifecycle


@hookspec(historic=True)
def miles_configure(config: MilesConfig) -> None:
    """Called once the config is validated, before any component starts.

    Historic: a plugin registered later still receives the call.

    :param config: the validated config.
    """


@hookspec
def miles_run_start(config: MilesConfig, run_dir: Path) -> None:
    """Called when ``miles train`` has started every component, before the first step.

    :param config: the validated config.
    :param run_dir: the run's output folder (``runs/<name>``).
    """


@hookspec
def miles_step_end(step: int, metrics: dict[str, float]) -> None:
    """Called after each RL step, before metrics are logged.

    Implementations may add entries to ``metrics`` (they are logged with the step's own).

    :param step: the step just finished (1-based).
    :param metrics: the step's metrics; mutable.
    """


@hookspec
def miles_weights_synced(version: int) -> None:
    """Called after every engine received weights of ``version``.

    :param version: the new engine weight version.
    """


@hookspec
def miles_run_end(run_dir: Path, status: str) -> None:
    """Called when a run ends (``completed``, ``failed`` or ``interrupted``), after cleanup.

    :param run_dir: the run's output folder.
    :param status: how the run ended.
    """
