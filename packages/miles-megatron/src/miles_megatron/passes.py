"""Forward (and backward) passes over a batch through megatron-core's pipeline schedules.

The batch is planned like every Miles backend plans it (:mod:`miles_algorithms.planning`): rows
spread over data-parallel replicas, packed into micro-batches by token budget, the same number on
every replica (an idle one runs a padding micro-batch). Each micro-batch becomes packed THD input
(:mod:`miles_megatron.inputs`) and goes through ``get_forward_backward_func()`` - no pipelining,
1F1B, or interleaved 1F1B, as the layout says. Each forward runs inside the ``miles_forward``
wrappers with ``ctx.model`` = the megatron-core ``GPTModel`` chunk and ``ctx.state["inputs"]`` =
the :class:`~miles_megatron.inputs.MicroInputs` it received.

On the last pipeline stage the decoder's hidden states go through the vocabulary-parallel,
chunked head (:mod:`miles_megatron.head`) for the wanted tokens only; with context parallelism
the ``[b, t]`` outputs are summed over the context-parallel group so the loss sees whole rows.

Loss scaling: ``miles_algorithms`` gives each micro-batch's *share* of the batch loss (shares add
up over micro-batches and replicas). megatron-core's schedule multiplies a loss by the
context-parallel size and divides it by the number of micro-batches, and its DDP averages
gradients over data x context ranks; so the loss handed to the schedule is
``share x micro-batches x data-parallel size``, and the resulting gradient is exactly that of the
sum of shares.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from miles_algorithms.planning import plan_micro_batches, row_lengths
from miles_contracts import ForwardContext, TrainBatch

from miles_megatron import inputs as packing
from miles_megatron import rope
from miles_megatron.head import ReduceForward, token_logprobs
from miles_megatron.parallel import Layout, all_reduce

if TYPE_CHECKING:
    from miles.kernel import Kernel
    from miles_contracts import ModelBridge

    from miles_megatron.model import ModelParts

LossFn = Callable[[TrainBatch, tuple[torch.Tensor, ...]], tuple[torch.Tensor, dict[str, float]]]


@dataclass(slots=True)
class Micro:
    """One micro-batch of this replica: its rows, the sub-batch and the packed model inputs."""

    index: int
    rows: list[int]
    batch: TrainBatch
    inputs: packing.MicroInputs


@contextlib.contextmanager
def hidden_states_out(model: Any) -> Iterator[None]:
    """``GPTModel`` returns its final hidden states instead of logits while inside.

    ``GPTModel._postprocess`` returns the hidden states when ``post_process`` is False; the flag
    is flipped on the model object only (the decoder keeps its final norm), for one forward.
    """
    saved = model.post_process
    model.post_process = False
    try:
        yield
    finally:
        model.post_process = saved


@dataclass(slots=True)
class PassRunner:
    kernel: Kernel
    parts: ModelParts
    layout: Layout
    bridge: ModelBridge | None
    token_budget: int
    chunk: int
    temperature: float
    device: torch.device
    backend_name: str = "megatron"
    compiled: bool = False  # the head's per-chunk maths through torch.compile
    _outputs: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)

    # ------------------------------------------------------------------ planning

    def micro_batches(self, batch: TrainBatch) -> list[Micro]:
        from megatron.core import parallel_state as ps

        if "cu_seqlens" in batch.extras:
            raise ValueError("the megatron backend takes padded [B, T] batches (it packs them itself); got a packed batch")
        if bool((batch.loss_mask[:, 0] > 0).any()):
            raise ValueError("loss_mask[:, 0] must be 0: the first token of a row has no context to be predicted from")
        lengths = row_lengths(batch.attention_mask)
        if bool(((batch.loss_mask > 0) & (batch.attention_mask == 0)).any()):
            raise ValueError("loss_mask is non-zero on padding (attention_mask 0); the loss mask must lie inside each row")
        # the budget is per micro-batch of the whole context-parallel group
        plan = plan_micro_batches(lengths, self.token_budget, self.layout.dp, multiple_of=self.layout.pp if self.layout.vpp else 1)
        mine = plan[ps.get_data_parallel_rank()]
        cp_rank = ps.get_context_parallel_rank()
        micros = []
        for index, rows in enumerate(mine):
            sub = batch.select(rows) if rows else _empty_like(batch)
            built = packing.build(sub.tokens, sub.loss_mask, [lengths[r] for r in rows], tp=self.layout.tp,
                                  cp=self.layout.cp, cp_rank=cp_rank, device=self.device)
            micros.append(Micro(index, rows, sub.to(self.device), built))
        return micros

    # ------------------------------------------------------------------ the forward of one micro-batch

    def _forward(self, phase: str, micro: Micro, chunk_module: Any, with_entropy: bool) -> Any:
        from megatron.core import parallel_state as ps
        from megatron.core.utils import get_attr_wrapped_model

        model = get_attr_wrapped_model(chunk_module, "decoder", return_model_obj=True)
        inputs = micro.inputs
        sp = ((ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank())
              if self.parts.config.sequence_parallel else (1, 0))
        ctx = ForwardContext(phase=phase, model=model, batch=micro.batch, backend=self.backend_name, bridge=self.bridge,
                             state={"inputs": inputs, "dummy": not micro.rows,
                                    "token_positions": lambda: inputs.token_positions(*sp)})

        def run() -> Any:
            params = inputs.packed_seq_params(ps.get_context_parallel_group(),
                                              rope.angles(model, inputs.position_ids, inputs.max_seqlen))
            with hidden_states_out(model):
                hidden = model(inputs.input_ids, inputs.position_ids, None, packed_seq_params=params)
            if not model.post_process:
                return hidden  # sent to the next pipeline stage
            weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else model.output_layer.weight
            logprobs, entropy = token_logprobs(
                hidden.to(weight.dtype), weight, inputs.target_ids, inputs.hidden_index,
                vocab_start=ps.get_tensor_model_parallel_rank() * weight.shape[0], vocab_size=self.parts.vocab_size,
                sequence_parallel=self.parts.config.sequence_parallel, temperature=self.temperature,
                chunk=self.chunk, with_entropy=with_entropy, compiled=self.compiled,
            )
            outs = (logprobs,) if entropy is None else (logprobs, entropy)
            cp_group = ps.get_context_parallel_group()
            return tuple(ReduceForward.apply(inputs.scatter(o), cp_group) for o in outs)

        return self.kernel.run_forward(ctx, run)

    def _run(self, phase: str, micros: list[Micro], *, forward_only: bool, with_entropy: bool,
             loss_fn: LossFn | None, keep_outputs: bool = False) -> dict[str, float]:
        """One pipeline schedule over ``micros``. Outputs are kept for :meth:`collect` in a
        forward-only pass, and in a training pass with ``keep_outputs`` (the log-probs only)."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        shares: dict[str, float] = {}
        scale = float(len(micros) * self.layout.dp)

        def forward_step(data_iterator: Iterator[Micro], chunk_module: Any) -> tuple[Any, Callable]:
            micro = next(data_iterator)
            output = self._forward(phase, micro, chunk_module, with_entropy)

            def loss_func(outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, dict]:
                if forward_only:
                    self._outputs[micro.index] = tuple(o.detach() for o in outputs)
                    return outputs[0].sum() * 0.0, {}
                if not micro.rows:  # padding micro-batch: keeps collectives in step, adds nothing
                    return sum((o.sum() for o in outputs[1:]), outputs[0].sum()) * 0.0, {}
                assert loss_fn is not None  # a training pass is given one
                loss, metrics = loss_fn(micro.batch, outputs)
                for name, value in metrics.items():
                    shares[name] = shares.get(name, 0.0) + value
                if keep_outputs:
                    self._outputs[micro.index] = (outputs[0].detach(),)
                return loss * scale, {}

            return output, loss_func

        chunks = self.parts.wrapped
        iterators: Any = [iter(micros) for _ in chunks] if len(chunks) > 1 else iter(micros)
        longest = max(m.inputs.input_ids.shape[1] for m in micros)
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators, model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(micros), seq_length=longest, micro_batch_size=1, forward_only=forward_only,
        )
        last = ps.is_pipeline_last_stage(ignore_virtual=True)
        speaks = last and ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
        return shares if speaks else {}

    # ------------------------------------------------------------------ passes

    def collect(self, micros: list[Micro], shape: tuple[int, int], count: int) -> list[torch.Tensor]:
        """``[B, T]`` outputs of every micro-batch of every replica, on every rank."""
        from megatron.core import parallel_state as ps

        outs = [torch.zeros(shape, dtype=torch.float32, device=self.device) for _ in range(count)]
        speaks = (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
                  and ps.get_context_parallel_rank() == 0)
        if speaks:
            for micro in micros:
                if not micro.rows:
                    continue
                rows = torch.as_tensor(micro.rows, device=self.device)
                for out, values in zip(outs, self._outputs[micro.index], strict=False):
                    out[rows, : values.shape[1]] += values.float()
        self._outputs.clear()
        return [all_reduce(out) for out in outs]

    @torch.no_grad()
    def score(self, phase: str, batch: TrainBatch, *, with_entropy: bool = False) -> list[torch.Tensor]:
        """``[B, T]`` log-probs (and entropy) at ``loss_mask`` positions, 0 elsewhere; on every rank."""
        for chunk in self.parts.wrapped:
            chunk.eval()
        micros = self.micro_batches(batch)
        self._run(phase, micros, forward_only=True, with_entropy=with_entropy, loss_fn=None)
        for chunk in self.parts.wrapped:
            chunk.train()
        rows, width = batch.tokens.shape
        return [o.to(batch.tokens.device) for o in self.collect(micros, (rows, width), 1 + int(with_entropy))]

    def accumulate(self, phase: str, batch: TrainBatch, loss_fn: LossFn, *, with_entropy: bool = False,
                   keep_outputs: bool = False) -> tuple[dict[str, float], torch.Tensor | None]:
        """Forward + backward of every micro-batch; gradients accumulate in the DDP buffers.

        :returns: metric shares of this rank (non-zero only on ranks that speak for a replica:
            last pipeline stage, tensor- and context-parallel rank 0), and with ``keep_outputs``
            the pre-update log-probs ``[B, T]`` on every rank.
        """
        micros = self.micro_batches(batch)
        shares = self._run(phase, micros, forward_only=False, with_entropy=with_entropy, loss_fn=loss_fn,
                           keep_outputs=keep_outputs)
        rows, width = batch.tokens.shape
        kept = self.collect(micros, (rows, width), 1)[0] if keep_outputs else None
        self._outputs.clear()
        return shares, kept


def _empty_like(batch: TrainBatch) -> TrainBatch:
    return batch.select([])
