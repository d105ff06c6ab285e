"""Protocols every plugin implementation satisfies. Structural: no base class to inherit.

Heavy types (torch, transformers) appear only under ``TYPE_CHECKING``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from miles_contracts.cluster import Endpoint, Node
from miles_contracts.context import RunContext

if TYPE_CHECKING:
    import torch

    from miles_contracts.algorithm import AlgorithmParams
    from miles_contracts.batch import AdvantageResult, TrainBatch
    from miles_contracts.capture import EngineCapture
    from miles_contracts.sample import Sample
    from miles_contracts.weights import TransferReport
    from miles_contracts.wire.engine import GenerateRequest, GenerateResponse, SamplingParams


# --------------------------------------------------------------------------- scoring and selection

Score = float | Mapping[str, float]
"""What a reward returns for one sample: the episode's reward, or its per-role rewards."""



@runtime_checkable
class RewardFn(Protocol):
    """Scores a batch of samples: one float per sample, in order. Sync or ``async``.

    A reward that raises for one sample should return ``float('nan')`` for it rather than raise
    for the batch; the kernel marks NaN-scored samples FAILED with exit reason ``reward_error``.

    For an episode of several agents (its branches have several ``Branch.role``) a reward may
    return ``{role: float}`` for the sample instead: every branch of a listed role gets its role's
    reward, ``sample.reward`` the one of the sample's own role, which the mapping must hold.
    """

    def __call__(self, samples: Sequence[Sample]) -> Sequence[Score] | Awaitable[Sequence[Score]]: ...


@dataclass(frozen=True, slots=True)
class FilterVerdict:
    """A filter's decision on one prompt group. ``reason`` names the drop in metrics."""

    keep: bool
    reason: str | None = None


@runtime_checkable
class Filter(Protocol):
    """Decides whether a prompt group enters training. Filters form a pipeline: all must keep."""

    def __call__(self, group: Sequence[Sample]) -> FilterVerdict: ...


@runtime_checkable
class AdvantageEstimator(Protocol):
    """Turns rewards (and optionally values / log-probs) into per-token advantages.

    Must leave advantages zero wherever ``batch.loss_mask`` is zero, and must not change them when
    masked positions' inputs change. What it needs and promises (a critic, zero-sum groups) is
    declared in its :class:`~miles_contracts.specs.AdvantageSpec`; whitening and distillation are
    applied after it by the kernel, for every estimator alike.
    """

    def __call__(self, batch: TrainBatch, params: AlgorithmParams) -> AdvantageResult: ...


# --------------------------------------------------------------------------- rollout


class EngineClient(Protocol):
    """Talks to an engine or the router in the engine wire protocol.

    :ivar base_url: where it sends requests (the router's URL in a run); generators that start a
        server of their own in front of the engines (an in-process session server) use it.
    """

    base_url: str

    async def generate(self, request: GenerateRequest, *, routing_key: str | None = None) -> GenerateResponse: ...


@dataclass(slots=True)
class GenerateContext:
    """What a generator gets besides the sample.

    :ivar engine: client for the router (SGLang-native API).
    :ivar tokenizer: the model's HF tokenizer.
    :ivar sampling_params: default sampling for this call (evaluation may differ from training).
    :ivar max_context_len: prompt + response budget in tokens.
    :ivar run: the driver's :class:`~miles_contracts.context.RunContext` (its config and kernel:
        registries of tools, agents, chat families).
    :ivar session_server_url: base URL of the session server, if one runs (agentic generator).
    :ivar service_urls: base URLs of the run's other services by role (``{"sandbox": [...]}``), the
        ones the generator's or the agent's spec asked for.
    :ivar evaluation: True when generating for evaluation.
    :ivar partial_rollout: when the engine aborts a generation (a weight update paused it), go on
        with the tokens already sampled: resubmit prompt + partial output with the remaining
        budget, recording each call's weight version (``run.mode: fully_async``).
    :ivar captures: engine captures every generate call of this rollout must carry (see
        :mod:`miles_contracts.capture`); empty for evaluation.
    """

    engine: EngineClient
    tokenizer: Any
    sampling_params: SamplingParams
    max_context_len: int
    run: RunContext
    session_server_url: str | None = None
    service_urls: Mapping[str, Sequence[str]] = field(default_factory=dict)
    evaluation: bool = False
    captures: Sequence[EngineCapture] = ()
    partial_rollout: bool = False


@runtime_checkable
class Generator(Protocol):
    """Produces one rollout for ``sample`` (which carries prompt, label, metadata, group ids).

    Returns the same sample filled in (tokens, response, loss_mask, rollout_logprobs, status,
    weight_versions, token_versions), and the data of ``ctx.captures`` in its stash (``miles.rollout.capture``
    does both ends for a generator). An error costs this sample (status ABORTED/FAILED with an
    exit reason), never the run: generators catch and record, they do not raise for per-sample
    problems.
    """

    async def __call__(self, sample: Sample, ctx: GenerateContext) -> Sample: ...


class Tool(Protocol):
    """A tool for the multi-turn generator (OpenAI function-calling shape)."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments

    async def __call__(self, *args: Any, **arguments: Any) -> str:
        """The tool message text for the model's arguments (called with keywords, one per
        property of :attr:`parameters`; a tool declares its own named parameters)."""
        ...


AgentFn = Callable[[str, Any, dict[str, Any], dict[str, Any]], Awaitable[dict[str, Any] | None]]
"""``async def run_agent(base_url, prompt, request_kwargs, metadata) -> dict | None``."""


class DataSource(Protocol):
    """Yields prompts as samples (prompt, label, metadata). Position is checkpointable."""

    def next_prompts(self, n: int) -> list[Sample]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


# --------------------------------------------------------------------------- engines and routing


@dataclass(slots=True)
class EngineSpec:
    """How to start one engine.

    :ivar deterministic: start in the engine's deterministic mode (``run.deterministic``): a request's
        output must not depend on which requests share its batch, and a request's ``sampling_seed``
        must make its sampling reproducible (SGLang: ``--enable-deterministic-inference``; embedded:
        the same flag). An engine that cannot do it says so in its log rather than refusing.
    """

    model_path: str
    port: int
    host: str = "127.0.0.1"
    device: str = "auto"
    dtype: str = "auto"
    options: dict[str, Any] = field(default_factory=dict)
    deterministic: bool = False
    weight_dirs: list[str] = field(default_factory=list)
    """Folders the engine may load weight updates from (``/update_weights_from_disk``), besides its
    model's; the run passes its own folder, where the disk transport writes."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(slots=True)
class RouterRequest:
    """A request passing through the router middleware chain."""

    method: str
    path: str
    body: dict[str, Any] | None
    headers: dict[str, str]
    routing_key: str | None = None
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RouterResponse:
    status_code: int
    body: Any
    worker_url: str | None = None
    headers: dict[str, str] = field(default_factory=dict)


class RouterMiddleware(Protocol):
    """One link of the router's middleware chain (outermost first, in config order)."""

    async def __call__(
        self, request: RouterRequest, call_next: Callable[[RouterRequest], Awaitable[RouterResponse]]
    ) -> RouterResponse: ...


@runtime_checkable
class MiddlewareReport(Protocol):
    """What a middleware whose spec says ``reports=True`` also offers the router's ``/metrics``."""

    def snapshot(self) -> dict[str, Any]:
        """Its state as JSON data (``GET /metrics``, under the middleware's name)."""
        ...

    def prometheus(self) -> str:
        """Its metrics in Prometheus' text format (``GET /metrics?format=prometheus``); may be empty."""
        ...


# --------------------------------------------------------------------------- training and weights


class TrainBackend(Protocol):
    """Owns the actor (and optionally reference and critic) models and the optimiser."""

    def compute_logprobs(self, batch: TrainBatch, *, model: Literal["actor", "ref", "teacher"] = "actor") -> torch.Tensor:
        """``[B, T]`` log-probs of ``batch.tokens`` (zero off ``loss_mask``); no grad."""
        ...

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, T]`` critic values; raises if the backend has no critic."""
        ...

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimiser step on ``batch`` (which carries advantages); returns metrics."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full actor weights with HF names, for weight transport (gathered if sharded)."""
        ...

    def save_checkpoint(self, path: Path, extra_state: Mapping[str, Any]) -> None: ...

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Restore and return the ``extra_state`` saved with it."""
        ...

    def export_hf(self, path: Path) -> None: ...

    def close(self) -> None: ...


class WeightTransport(Protocol):
    """Moves HF-named weights from the trainer into engines and bumps their weight version."""

    def push(
        self, tensors: Iterable[tuple[str, torch.Tensor]], *, targets: Sequence[str], version: int
    ) -> TransferReport:
        """Deliver ``tensors`` to every engine URL in ``targets``; afterwards each engine serves
        exactly these weights and reports ``weight_version == version``."""
        ...

    def close(self) -> None: ...


class ModelBridge(Protocol):
    """Model-family knowledge: HF <-> Megatron weights, chat family, MoE layer map.

    ``hf_config`` is the model's ``config.json`` as a mapping (no transformers import needed).

    A bridge of a family with mixture-of-experts models also implements
    ``moe_layers(hf_config) -> MoeLayerMap | None`` (see :class:`~miles_contracts.MoeLayerMap`):
    where the routers are and how they weigh experts, None for a dense model. It is optional, so
    dense families need nothing; routing replay refuses a MoE model whose bridge lacks it.
    """

    name: str
    chat_family: str | None

    def to_megatron(
        self, hf_state: Mapping[str, torch.Tensor], hf_config: Mapping[str, Any], *, partial: bool = False,
    ) -> dict[str, torch.Tensor]:
        """HF checkpoint tensors -> megatron-core tensors.

        ``partial=True`` (optional, as for ``to_hf``): ``hf_state`` may hold any subset, and exactly
        the megatron tensors whose HF inputs are all in it are returned; a train backend then
        streams a checkpoint in one decoder layer at a time instead of holding all of it on every
        rank. Meta tensors should convert to meta tensors (names and shapes without the weights).
        A backend falls back to one whole-model call for a bridge without the keyword.
        """
        ...

    def to_hf(
        self, mcore_state: Mapping[str, torch.Tensor], hf_config: Mapping[str, Any], *, partial: bool = False,
    ) -> dict[str, torch.Tensor]:
        """megatron-core tensors -> HF checkpoint tensors.

        ``partial=True`` (optional; bridges that accept it let a train backend stream weights one
        decoder layer at a time): ``mcore_state`` may hold any subset, and exactly the HF tensors
        made from it are returned. A backend falls back to one whole-model call for a bridge whose
        ``to_hf`` has no ``partial`` keyword.
        """
        ...

    def megatron_config(self, hf_config: Mapping[str, Any]) -> dict[str, Any]:
        """Keyword arguments for megatron-core's ``TransformerConfig`` / ``GPTModel``.

        Shape: ``{"transformer_config": {...}, "gpt_model": {...}, "layer_spec": {"function": name,
        "kwargs": {...}}}`` -- kwargs of ``TransformerConfig`` (model only: no parallelism,
        precision or fusion settings), of ``GPTModel`` besides config and spec, and the function of
        ``megatron.core.models.gpt.gpt_layer_specs`` (with its kwargs) whose layer spec has the
        parameter names ``to_megatron`` produces.
        """
        ...


# --------------------------------------------------------------------------- orchestration


class Tracker(Protocol):
    """Receives metrics; one instance per run."""

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class Executor(Protocol):
    """Starts and supervises the processes of a run (trainer ranks, engines, router, session
    server) on the nodes it offers. ``local``: this machine; ``ray``: a Ray cluster.

    Process names are unique in a run (``trainer-0``, ``engine-1``, ``router``). Every process's
    output reaches ``<run>/logs/<name>.log``; ``shutdown`` leaves no process behind.
    """

    def nodes(self) -> list[Node]:
        """Every node the run may use, with all its GPUs: the capacity placement plans against."""
        ...

    def reserve(self, gpus: int) -> list[Node]:
        """Hold ``gpus`` GPUs for the run; the nodes holding them, each with only its reserved
        GPU ids, in a stable order (by address, the driver's node first among equals). With 0,
        the driver's node alone, without GPUs."""
        ...

    def driver_address(self) -> str:
        """The address processes on any node reach the driver at."""
        ...

    def launch(self, name: str, command: Callable[[Endpoint], Sequence[str]], *, node: str,
               gpus: Sequence[str] = (), health_path: str | None = None,
               env: Mapping[str, str] | None = None) -> Endpoint:
        """Start ``command(endpoint)`` on ``node`` (a free port there is picked for it) seeing only
        ``gpus`` (``CUDA_VISIBLE_DEVICES``); returns at once with the endpoint. ``command`` is
        called again on every restart."""
        ...

    def wait_healthy(self, name: str) -> None:
        """Block until ``health_path`` of ``name`` answers 200 (no-op without one); raise with the
        tail of its log if it exits or the start-up timeout passes. A process that exits with
        :data:`~miles_contracts.cluster.EXIT_ADDRESS_IN_USE` (its port was taken before it could
        listen) is started again on a newly picked port, a few times, before that counts as a
        failure; ``endpoint(name)`` then gives the new one."""
        ...

    def endpoint(self, name: str) -> Endpoint: ...

    def alive(self, name: str) -> bool: ...

    def returncode(self, name: str) -> int | None:
        """Exit status of a process that ended (negative: the signal that killed it), else None."""
        ...

    def restart(self, name: str, *, wait: bool = True) -> Endpoint:
        """Start a dead (or live) process again (and wait until it is healthy); it may come back
        on another node (its node left the cluster), so the endpoint may change."""
        ...

    def supervise(self, on_death: Callable[[str], None]) -> None:
        """Call ``on_death(name)`` from a watcher thread for each process found dead."""
        ...

    def manifest(self) -> list[dict[str, Any]]:
        """One row per process for ``<run>/services.json``: name, node, pid, GPUs, restarts, log."""
        ...

    def shutdown(self) -> None: ...


@dataclass(slots=True)
class ForwardContext:
    """What a forward-pass wrapper sees (see ``miles_forward`` in the hook specs).

    :ivar phase: ``old_logprobs`` | ``ref_logprobs`` | ``teacher_logprobs`` | ``values`` | ``train``
        | ``critic_train`` (the critic's forward with gradient; ``train`` is always the actor's).
    :ivar model: the module about to run (an ``nn.Module``).
    :ivar batch: the (micro-)batch it runs on.
    :ivar backend: registered name of the train backend.
    :ivar bridge: model bridge of the model, if one claimed it.
    :ivar state: scratch space shared by wrappers of one call. Backends put there what a wrapper
        needs to relate the model's view to ``batch``; keys every backend should provide:
        ``"token_positions"``: a callable returning ``[N]`` int64, for each token the model's
        layers see (in the order they see them: ``[b, t]`` row-major when padded, rows one after
        the other when packed, a rank's shard under sequence/context parallelism), its flat index
        ``b * T + t`` into ``batch``, or -1 for a token that is not in ``batch`` (padding);
        ``"dummy"``: True for a forward that only keeps ranks in step (its result is discarded).
        Optional: ``"true_on_policy_step"``: the RL step, set only when the forward runs with
        exactly the weights that sampled ``batch`` and the same batch-invariant forward as the
        engine (``rollout.true_on_policy``, sync mode, before the step's first update), so what
        the rollout recorded about these tokens (log-probs, MoE routing) must agree exactly.
    """

    phase: str
    model: Any
    batch: TrainBatch
    backend: str
    bridge: ModelBridge | None = None
    state: dict[str, Any] = field(default_factory=dict)


AsyncSamples = AsyncIterator["Sample"]
