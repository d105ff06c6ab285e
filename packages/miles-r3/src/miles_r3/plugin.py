"""Plugin ``r3`` (distribution miles-r3): the ``r3`` config section, the routed-experts engine
capture, the replaying ``miles_forward`` wrapper and the per-step agreement metrics.

Nothing happens unless the run says ``r3.enabled: true``: no capture is returned, no batch carries
routed experts, and the wrapper returns at its first check. For a dense model (its bridge gives no
MoE layer map) enabling it does nothing either. Light at import: torch and numpy load on first use.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from miles import hookimpl
from miles.registry import Register
from miles_contracts import CommandSpec, ConfigSectionSpec, RunContext

from miles_r3 import ROUTED_EXPERTS_NAME

if TYPE_CHECKING:
    from miles.config import MilesConfig
    from miles_contracts import EngineCapture, ForwardContext

    from miles_r3.config import R3Section
    from miles_r3.replay import Replayer, RoutingStats

log = logging.getLogger(__name__)


class _ProcessState:
    """This process's part of the run: settings (from ``miles_configure``), statistics, and the
    replayer bound to each model seen (None for a dense one)."""

    def __init__(self) -> None:
        self._settings: R3Section | None = None
        self._stats: RoutingStats | None = None
        self._replayers: weakref.WeakKeyDictionary[Any, Replayer | None] = weakref.WeakKeyDictionary()
        # rollout.true_on_policy_check: what a routing mismatch of an exact forward does
        self.on_policy_check: str = "error"

    @property
    def settings(self) -> R3Section:
        if self._settings is None:  # a backend used without a configured run: replay what batches carry
            from miles_r3.config import R3Section

            self._settings = R3Section()
        return self._settings

    @settings.setter
    def settings(self, value: R3Section) -> None:
        self._settings = value

    @property
    def stats(self) -> RoutingStats:
        if self._stats is None:
            from miles_r3.replay import RoutingStats

            self._stats = RoutingStats()
        return self._stats

    def replayer(self, ctx: ForwardContext) -> Replayer | None:
        model = ctx.model
        if model not in self._replayers:
            self._replayers[model] = _bind(ctx, self.stats)
        return self._replayers[model]


STATE = _ProcessState()


def _bind(ctx: ForwardContext, stats: RoutingStats) -> Replayer | None:
    """A replayer for ``ctx.model``'s routers: megatron-core's when it has them, else the HF
    routers its bridge's MoE layer map names; None for a dense model."""
    from miles_r3.megatron import MegatronRouterReplay, megatron_routers

    routers = megatron_routers(ctx.model)
    if routers:
        return MegatronRouterReplay(routers, stats)
    from miles_r3.hf import HFRouterReplay
    from miles_r3.layer_map import layer_map_of

    config = getattr(ctx.model, "config", None)
    hf_config = config.to_dict() if config is not None and hasattr(config, "to_dict") else {}
    layer_map = layer_map_of(ctx.bridge, hf_config)
    return HFRouterReplay(ctx.model, layer_map, stats) if layer_map is not None else None


@hookimpl
def miles_register_config_sections(register: Register[ConfigSectionSpec]) -> None:
    from miles_r3.config import R3Section

    register("r3", ConfigSectionSpec(R3Section))


@hookimpl
def miles_configure(config: MilesConfig, ctx: RunContext) -> None:
    """This process's settings (the trainer ranks' replay reads them)."""
    from miles_r3.config import R3Section

    STATE.settings = config.section("r3", R3Section)
    STATE.on_policy_check = config.rollout.true_on_policy_check


@hookimpl
def miles_engine_captures(config: MilesConfig, ctx: RunContext) -> list[EngineCapture]:
    """The routed-experts capture when ``r3.enabled`` and the model is a MoE model (in the driver)."""
    from miles_r3.config import R3Section

    if not config.section("r3", R3Section).enabled:
        return []
    from miles_r3.capture import RoutedExpertsCapture
    from miles_r3.layer_map import layer_map_of_run

    layer_map = layer_map_of_run(config, ctx.kernel)
    if layer_map is None:
        log.info("r3: %s is a dense model; there is no routing to record or replay", config.model.name)
        return []
    return [RoutedExpertsCapture(layer_map)]


@hookimpl(wrapper=True)
def miles_forward(ctx: ForwardContext) -> Generator[None, Any, Any]:
    """Force every MoE router to the batch's recorded experts for the duration of this forward
    (and of its recomputation in backward under activation checkpointing). In a forward the
    backend marks ``true_on_policy_step`` (the weights that sampled the batch, the engine's
    invariant forward) the routers' own choice must equal the rollout's on every (token, MoE
    layer) pair: a mismatch fails the step, or is counted with ``rollout.true_on_policy_check: metric``."""
    batch = ctx.batch  # None in a forward that runs on no batch (kernel tests of the wrapper chain)
    experts = batch.extras.get(ROUTED_EXPERTS_NAME) if batch is not None else None
    if experts is None or ctx.phase not in STATE.settings.phases or ctx.state.get("dummy"):
        return (yield)
    replayer = STATE.replayer(ctx)
    if replayer is None:
        return (yield)
    step = ctx.state.get("true_on_policy_step")
    table = _table(ctx, experts, replayer, exact=step is not None)
    replayer.arm(table, keep_for_recompute=replayer.recomputes(ctx.model))
    try:
        result = yield
    finally:
        replayer.release()
    if step is not None and STATE.on_policy_check == "error":
        _check_routing(ctx, table, replayer, step)
    return result


class RoutingMismatch(RuntimeError):
    """A true on-policy forward routed a token to other experts than the rollout did."""


def _check_routing(ctx: ForwardContext, table: Any, replayer: Replayer, step: int) -> None:
    found = table.first_mismatch()
    if found is None:
        return
    token, column, own, rollout, count, checked = found
    width = ctx.batch.tokens.shape[1]
    row, col = divmod(int(table.positions[token]), width)
    layer_map = getattr(replayer, "layer_map", None)
    layer = f"MoE layer {column}" + (f" (router {layer_map.router_path(layer_map.moe_layers[column])})"
                                     if layer_map is not None else "")
    raise RoutingMismatch(
        f"true on-policy routing check: step {step}, sample {int(ctx.batch.rollout_ids[row])} (batch row {row}), "
        f"token {col} of the sequence (token id {int(ctx.batch.tokens[row, col])}), {layer}: the trainer routed "
        f"to experts {own}, the rollout to {rollout}; {count} of {checked} (token, MoE layer) pairs of this "
        f"{ctx.phase} forward differ. Set rollout.true_on_policy_check: metric to count them "
        f"(r3/{ctx.phase}/true_on_policy_mismatched_pairs) instead of failing"
    )


def _table(ctx: ForwardContext, experts: Any, replayer: Replayer, *, exact: bool = False) -> Any:
    from miles.errors import MilesError

    from miles_r3.replay import ReplayTable, line_up

    _, _, layers, k = experts.shape
    if (layers, k) != (replayer.columns, replayer.top_k):
        raise MilesError(f"the batch's routed experts are {layers} MoE layers x top-{k}; the model has "
                         f"{replayer.columns} x top-{replayer.top_k}")
    positions = ctx.state.get("token_positions")
    if positions is None:
        raise MilesError(f"backend {ctx.backend!r} gives no ForwardContext.state['token_positions']; routing replay "
                         f"needs it to line the recorded experts up with the tokens the routers see")
    uses = 2 if replayer.recomputes(ctx.model) else 1
    flat = positions()
    forced, recorded, unrecorded = line_up(experts, flat, replayer.num_experts, ctx.batch.size)
    return ReplayTable(forced, recorded, phase=ctx.phase, replay=STATE.settings.replay, uses=uses,
                       unrecorded=unrecorded, exact=exact, positions=flat if exact else None)


@hookimpl
def miles_register_commands(register: Register[CommandSpec]) -> None:
    def add_arguments(parser: Any) -> None:
        from miles_r3.bench import add_arguments as add

        add(parser)

    def run(args: Any, ctx: RunContext) -> int:
        from miles_r3.bench import run as bench

        return bench(args, ctx)

    register("bench r3", CommandSpec("routing replay: train/rollout log-prob gap and routing agreement with and "
                                     "without replay (MoE), its cost (dense)", run, add_arguments=add_arguments))


@hookimpl
def miles_train_step_end(metrics: dict[str, float]) -> None:
    """Add the step's ``r3/<phase>/...`` agreement metrics (see :meth:`RoutingStats.flush`), in the
    trainer rank process where the forwards ran (rank 0's share of the batch is what is reported)."""
    if STATE._stats is not None:
        metrics.update(STATE.stats.flush())
