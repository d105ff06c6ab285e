"""Micro-batch loops over a batch: scoring passes (no gradient) and gradient accumulation.

Each forward runs inside :meth:`miles.kernel.Kernel.run_forward`, so ``miles_forward`` wrappers
(routing replay, probes) see every pass with its phase, the HF module and the micro-batch (padded
``[b, t]`` view). ``ctx.state["inputs"]`` holds the :class:`~miles_fsdp.packing.ModelInputs` the
module actually receives (packed ``[1, N]`` with ``cu_seqlens``, or padded), and
``ctx.state["token_positions"]`` (see ``ForwardContext``) maps the tokens the layers see back to
the micro-batch, so a wrapper can line per-token batch tensors up with them.

Every rank runs the same number of forwards (see :mod:`miles_fsdp.packing`); a rank without rows
for a micro-batch runs a dummy one and contributes zero.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from miles_contracts import ForwardContext, TrainBatch

from miles_fsdp.distributed import DistContext, all_reduce_sum
from miles_fsdp.models import PolicyModel, ValueModel
from miles_fsdp.packing import ModelInputs, build_inputs, dummy_inputs, plan_micro_batches, row_lengths
from miles_fsdp.prefix_tree import TreePolicy

if TYPE_CHECKING:
    from miles.kernel import Kernel
    from miles_contracts import ModelBridge

# (micro-batch, [b, t] outputs of the forward) -> (loss share, metric shares)
LossFn = Callable[[TrainBatch, tuple[torch.Tensor, ...]], tuple[torch.Tensor, dict[str, float]]]


def _dummy_batch() -> TrainBatch:
    zeros = torch.zeros(1, 2)
    return TrainBatch(
        tokens=torch.zeros(1, 2, dtype=torch.long), attention_mask=torch.ones(1, 2, dtype=torch.long),
        loss_mask=zeros, rollout_logprobs=zeros, rewards=torch.zeros(1), group_ids=torch.zeros(1, dtype=torch.long),
        rollout_ids=torch.zeros(1, dtype=torch.long),
    )


PACKING_MIN_GAIN = 0.10
DEFAULT_PAIR_COST = 1e-3
MASKED_ATTENTION_PENALTY = 2.0


def attention_pair_cost(hf_config: Any) -> float:
    """Cost of attending one (query, key) pair, in units of one token's matrix multiplies (per layer).

    ``4 * q_width`` FLOPs per pair (``Q K^T`` and ``P V``) against ``2 * matmul weights`` per token,
    times a penalty for the masked attention kernel, which runs well below the GEMMs' rate. About
    1/1500 for SmolLM2-135M, 1/1900 for Qwen3-0.6B; falls back to 1/1000 for configs it cannot read.
    """
    def get(key: str, default: Any = None) -> Any:  # a missing value is None: int(None) is a TypeError below
        return hf_config.get(key, default) if isinstance(hf_config, dict) else getattr(hf_config, key, default)

    try:
        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        head_dim = int(get("head_dim") or hidden // heads)
        q, kv = heads * head_dim, int(get("num_key_value_heads") or heads) * head_dim
        inter = int(get("moe_intermediate_size") or 0) * int(get("num_experts_per_tok") or 0) or int(get("intermediate_size"))
    except (TypeError, ValueError):
        return DEFAULT_PAIR_COST
    per_token = 2.0 * (hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter)
    return MASKED_ATTENTION_PENALTY * 4.0 * q / per_token


def worth_packing(attention_mask: torch.Tensor, pair_cost: float = DEFAULT_PAIR_COST) -> bool:
    """Pack a micro-batch's rows into one sequence only when that is at least 10% cheaper.

    Without a variable-length attention kernel, packed rows need a dense block-diagonal mask over
    all ``N`` tokens, so attention does ``N^2`` pair work where padded rows do ``rows * width^2``;
    padding wastes ``rows * width - N`` tokens of matrix multiplies instead. Many short rollouts
    (the common RL case: 256 rows of ~80 tokens) therefore run far faster padded, equal-length rows
    always do, and one long row with a few short ones packs. ``pair_cost`` is
    :func:`attention_pair_cost` of the model.
    """
    if attention_mask.shape[0] < 2:
        return False
    padded, packed = layout_costs(attention_mask, pair_cost)
    return packed < (1.0 - PACKING_MIN_GAIN) * padded


def layout_costs(attention_mask: torch.Tensor, pair_cost: float = DEFAULT_PAIR_COST) -> tuple[float, float]:
    """``(padded, packed)`` cost of a micro-batch's rows, in tokens of matrix multiplies plus
    attended pairs times ``pair_cost`` (see :func:`worth_packing`)."""
    rows, width = attention_mask.shape
    return _layout_costs(rows, width, float(attention_mask.sum()), pair_cost)


def _layout_costs(rows: int, width: int, n: float, pair_cost: float) -> tuple[float, float]:
    return rows * width * (1.0 + pair_cost * width), n * (1.0 + pair_cost * n)


def flat_cost(lengths: list[int], pair_cost: float, packing: bool) -> float:
    """What rows of ``lengths`` cost in the flat layout the runner picks for them: padded to the
    longest, or packed when ``packing`` is on and :func:`worth_packing` would pack them."""
    padded, packed = _layout_costs(len(lengths), max(lengths), float(sum(lengths)), pair_cost)
    return packed if packing and len(lengths) > 1 and packed < (1.0 - PACKING_MIN_GAIN) * padded else padded


@dataclass(slots=True)
class PassRunner:
    """Runs modules over batches, micro-batch by micro-batch, on this rank's share of rows."""

    kernel: Kernel
    dist: DistContext
    bridge: ModelBridge | None
    packing: bool
    token_budget: int
    chunk: int
    temperature: float
    backend_name: str = "fsdp"
    compile_head: bool = False
    pair_cost: float = DEFAULT_PAIR_COST
    attention: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)
    prefix_tree: TreePolicy | None = None  # None: rows always run flat
    # (phase, module) -> the RL step whose rollout sampled with exactly the weights this forward
    # uses, under true on-policy (ForwardContext.state["true_on_policy_step"]); None for any other
    on_policy_step: Callable[[str, torch.nn.Module], int | None] = field(default=lambda phase, module: None)

    # ------------------------------------------------------------------ plumbing

    def my_micro_batches(self, batch: TrainBatch) -> list[list[int]]:
        if "cu_seqlens" in batch.extras:
            raise ValueError("the fsdp backend takes padded [B, T] batches (it packs them itself); got a packed batch")
        lengths = row_lengths(batch.attention_mask)
        if self.prefix_tree is not None and self.prefix_tree.plans_trees:
            # rows sharing a prefix are planned together, micro-batches budgeted by tree size; the
            # rows' tokens as bytes (sorted and compared at C speed, a fixed-width encoding)
            ids = batch.tokens.cpu().numpy()
            keys = [ids[r, :n].tobytes() for r, n in enumerate(lengths)]
            plan = self.prefix_tree.plan(keys, self.token_budget, self.dist.world_size,
                                         lambda rows: flat_cost(rows, self.pair_cost, self.packing),
                                         item_size=ids.itemsize)
            if plan is not None:
                return plan[self.dist.rank]
        return plan_micro_batches(lengths, self.token_budget, self.dist.world_size)[self.dist.rank]

    def _inputs(self, batch: TrainBatch, rows: list[int]) -> tuple[TrainBatch, ModelInputs, bool]:
        """The micro-batch of ``rows`` on the device and its model inputs; a dummy when ``rows`` is empty."""
        if not rows:
            return _dummy_batch().to(self.dist.device), dummy_inputs(self.dist.device), True
        micro = batch.select(rows)
        # inputs are planned on the host copy (no device syncs), then moved
        packed = self.packing and worth_packing(micro.attention_mask, self.pair_cost)
        inputs = None
        if self.prefix_tree is not None:
            lengths = row_lengths(micro.attention_mask)
            inputs = self.prefix_tree.inputs(micro, lengths, flat_cost(lengths, self.pair_cost, self.packing),
                                             self.dist.device)
        if inputs is None:
            inputs = build_inputs(micro, packed=packed, device=self.dist.device)
        return micro.to(self.dist.device), inputs, False

    def forward(self, phase: str, module: torch.nn.Module, micro: TrainBatch, inputs: ModelInputs,
                *, with_entropy: bool = False, dummy: bool = False) -> tuple[torch.Tensor, ...]:
        """``[K]`` outputs of ``module`` on ``inputs``, through the ``miles_forward`` wrappers."""
        hf = module.hf if isinstance(module, PolicyModel) else module.base
        state: dict[str, Any] = {"inputs": inputs, "dummy": dummy, "token_positions": inputs.token_positions}
        step = self.on_policy_step(phase, module)
        if step is not None:
            state["true_on_policy_step"] = step
        ctx = ForwardContext(phase=phase, model=hf, batch=micro, backend=self.backend_name, bridge=self.bridge,
                             state=state)

        def run() -> tuple[torch.Tensor, ...]:
            if isinstance(module, ValueModel):
                return (module(inputs.input_ids, inputs.position_ids, inputs.attention_mask, inputs.hidden_index),)
            logprobs, entropy = module(
                inputs.input_ids, inputs.position_ids, inputs.attention_mask, inputs.hidden_index, inputs.target_ids,
                temperature=self.temperature, chunk=self.chunk, with_entropy=with_entropy, compiled=self.compile_head,
            )
            return (logprobs,) if entropy is None else (logprobs, entropy)

        with self.attention():
            return self.kernel.run_forward(ctx, run)

    # ------------------------------------------------------------------ passes

    @torch.no_grad()
    def score(self, phase: str, module: torch.nn.Module, batch: TrainBatch, *, with_entropy: bool = False) -> list[torch.Tensor]:
        """``[B, T]`` outputs (log-probs [, entropy] or values) at ``loss_mask`` positions, 0 elsewhere.

        Collective: every rank returns the full result.
        """
        was_training = module.training
        module.eval()
        b, t = batch.tokens.shape
        n_outputs = 1 if isinstance(module, ValueModel) else 1 + int(with_entropy)
        outs = [torch.zeros(b, t, dtype=torch.float32, device=self.dist.device) for _ in range(n_outputs)]
        for rows in self.my_micro_batches(batch):
            micro, inputs, dummy = self._inputs(batch, rows)
            results = self.forward(phase, module, micro, inputs, with_entropy=with_entropy, dummy=dummy)
            if dummy:
                continue
            global_rows = torch.as_tensor(rows, device=self.dist.device)[inputs.rows]
            for out, values in zip(outs, results, strict=True):
                out.index_put_((global_rows, inputs.cols), values.float())
        module.train(was_training)
        # each position is written by exactly one rank and is exactly 0 on the others
        return [all_reduce_sum(out).to(batch.tokens.device) for out in outs]

    def accumulate(self, phase: str, module: torch.nn.Module, batch: TrainBatch, loss_fn: LossFn,
                   *, with_entropy: bool = False, keep_outputs: bool = False) -> tuple[dict[str, float], torch.Tensor | None]:
        """Forward + backward of every micro-batch; gradients accumulate in ``module``.

        ``batch`` has gone through ``prepare_batch``, so the loss shares of all micro-batches on
        all ranks add up to the batch loss. FSDP averages gradients over ranks, hence the loss is
        scaled by the world size before ``backward``.

        :returns: metric shares summed over this rank's micro-batches (not yet over ranks), and,
            with ``keep_outputs``, this rank's detached first outputs scattered into ``[B, T]``.
        """
        module.train()
        b, t = batch.tokens.shape
        kept = torch.zeros(b, t, dtype=torch.float32, device=self.dist.device) if keep_outputs else None
        metrics: dict[str, float] = {}
        for rows in self.my_micro_batches(batch):
            micro, inputs, dummy = self._inputs(batch, rows)
            results = self.forward(phase, module, micro, inputs, with_entropy=with_entropy, dummy=dummy)
            if dummy:
                # keep FSDP's reduce-scatter in lockstep with the other ranks; contributes zero
                with self.attention():
                    sum((r.sum() for r in results[1:]), results[0].sum()).mul(0.0).backward()
                continue
            loss, shares = loss_fn(micro, tuple(inputs.scatter(r) for r in results))
            with self.attention():
                (loss * self.dist.world_size).backward()
            for name, value in shares.items():
                metrics[name] = metrics.get(name, 0.0) + value
            if kept is not None:
                global_rows = torch.as_tensor(rows, device=self.dist.device)[inputs.rows]
                kept.index_put_((global_rows, inputs.cols), results[0].detach().float())
        return metrics, kept
