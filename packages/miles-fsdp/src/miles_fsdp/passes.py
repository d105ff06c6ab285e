"""Micro-batch loops over a batch: scoring passes (no gradient) and gradient accumulation.

Each forward runs inside :meth:`miles.kernel.Kernel.run_forward`, so ``miles_forward`` wrappers
(routing replay, probes) see every pass with its phase, the HF module and the micro-batch (padded
``[b, t]`` view). ``ctx.state["inputs"]`` holds the :class:`~miles_fsdp.packing.ModelInputs` the
module actually receives (packed ``[1, N]`` with ``cu_seqlens``, or padded), so a wrapper can map
per-token batch tensors to the packed order.

Every rank runs the same number of forwards (see :mod:`miles_fsdp.packing`); a rank without rows
for a micro-batch runs a dummy one and contributes zero.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from miles_contracts import ForwardContext, TrainBatch

from miles_fsdp.distributed import DistContext, all_reduce_sum
from miles_fsdp.models import PolicyModel, ValueModel
from miles_fsdp.packing import ModelInputs, build_inputs, dummy_inputs, plan_micro_batches, row_lengths

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


PACKING_MIN_WASTE = 0.10


def worth_packing(attention_mask: torch.Tensor) -> bool:
    """Pack a micro-batch only when padding would waste more than 10% of its positions.

    Packed rows need a block-diagonal mask, which rules out the fused causal attention kernels and
    costs an ``[N, N]`` mask; equal-length rows (long rollouts, benchmarks) run faster padded with
    no mask at all. Measured on the H200 at 4 x 4K tokens: packed 8.8% MFU, see docs/benchmarks/train.md.
    """
    rows, width = attention_mask.shape
    return rows > 1 and float(attention_mask.sum()) < (1.0 - PACKING_MIN_WASTE) * rows * width


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

    # ------------------------------------------------------------------ plumbing

    def my_micro_batches(self, batch: TrainBatch) -> list[list[int]]:
        if "cu_seqlens" in batch.extras:
            raise ValueError("the fsdp backend takes padded [B, T] batches (it packs them itself); got a packed batch")
        lengths = row_lengths(batch.attention_mask)
        return plan_micro_batches(lengths, self.token_budget, self.dist.world_size)[self.dist.rank]

    def _inputs(self, batch: TrainBatch, rows: list[int]) -> tuple[TrainBatch, ModelInputs, bool]:
        """The micro-batch of ``rows`` on the device and its model inputs; a dummy when ``rows`` is empty."""
        if not rows:
            return _dummy_batch().to(self.dist.device), dummy_inputs(self.dist.device), True
        micro = batch.select(rows)
        # inputs are planned on the host copy (no device syncs), then moved
        inputs = build_inputs(micro, packed=self.packing and worth_packing(micro.attention_mask), device=self.dist.device)
        return micro.to(self.dist.device), inputs, False

    def forward(self, phase: str, module: torch.nn.Module, micro: TrainBatch, inputs: ModelInputs,
                *, with_entropy: bool = False, dummy: bool = False) -> tuple[torch.Tensor, ...]:
        """``[K]`` outputs of ``module`` on ``inputs``, through the ``miles_forward`` wrappers."""
        hf = module.hf if isinstance(module, PolicyModel) else module.base
        ctx = ForwardContext(phase=phase, model=hf, batch=micro, backend=self.backend_name, bridge=self.bridge,
                             state={"inputs": inputs, "dummy": dummy})

        def run() -> tuple[torch.Tensor, ...]:
            if isinstance(module, ValueModel):
                return (module(inputs.input_ids, inputs.position_ids, inputs.attention_mask, inputs.hidden_index),)
            logprobs, entropy = module(
                inputs.input_ids, inputs.position_ids, inputs.attention_mask, inputs.hidden_index, inputs.target_ids,
                temperature=self.temperature, chunk=self.chunk, with_entropy=with_entropy,
            )
            return (logprobs,) if entropy is None else (logprobs, entropy)

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
                sum(r.sum() for r in results).mul(0.0).backward()
                continue
            loss, shares = loss_fn(micro, tuple(inputs.scatter(r) for r in results))
            (loss * self.dist.world_size).backward()
            for name, value in shares.items():
                metrics[name] = metrics.get(name, 0.0) + value
            if kept is not None:
                global_rows = torch.as_tensor(rows, device=self.dist.device)[inputs.rows]
                kept.index_put_((global_rows, inputs.cols), results[0].detach().float())
        return metrics, kept


def sum_over_ranks(metrics: dict[str, float], dist_ctx: DistContext) -> dict[str, float]:
    """Sum metric shares over ranks; ranks may have seen different keys (idle ranks see none)."""
    import torch.distributed as dist

    names: list[Any] = sorted(metrics)
    if dist_ctx.world_size > 1:
        gathered: list[list[str]] = [[] for _ in range(dist_ctx.world_size)]
        dist.all_gather_object(gathered, names)
        names = sorted({n for part in gathered for n in part})
    values = torch.tensor([metrics.get(n, 0.0) for n in names], dtype=torch.float64)
    all_reduce_sum(values)
    return dict(zip(names, values.tolist(), strict=True))
