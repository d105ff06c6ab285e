"""One micro-batch as megatron-core's packed (THD) input, split for context parallelism.

The rows of a micro-batch are laid one after the other, without padding between them, in a
``[1, N]`` sequence; ``cu_seqlens`` tell attention and rotary embeddings where each row starts.
Two constraints add a few padding tokens, at row ends only (causal attention never lets a real
token see them):

* context parallelism splits each row into ``2 * cp`` equal chunks, so rows are padded to a
  multiple of ``2 * cp``;
* sequence parallelism splits each rank's share along the sequence over ``tp`` ranks, so one
  padding row at the end makes the total a multiple of ``cp * tp`` (and of ``2 * cp``).

Entry ``[r, t]`` of a batch is token ``t`` predicted from tokens ``:t``, so the log-prob of a
loss-mask position comes from the hidden state one position earlier. Targets and wanted positions
are computed on the whole packed sequence first, then split like the tokens, so a chunk boundary
never loses a target.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class MicroInputs:
    """What one rank feeds the model for one micro-batch, and where its outputs go.

    :ivar input_ids / position_ids: ``[1, n]`` this rank's tokens (its context-parallel share).
    :ivar cu_seqlens: ``[rows + 1]`` int32 starts of the (padded) rows in the *whole* packed
        sequence, as megatron-core's THD layout wants them on every context-parallel rank.
    :ivar bounds: the same starts on the host (attention slices by them without a device sync).
    :ivar max_seqlen: longest padded row.
    :ivar hidden_index: ``[K]`` positions (into this rank's ``n``) whose hidden state predicts a
        wanted token; ``target_ids``: ``[K]`` those tokens.
    :ivar rows / cols: ``[K]`` where each wanted token sits in the micro-batch (``[b, t]``).
    :ivar token_index: ``[n, 2]`` (row, column) in the micro-batch of every local token, ``-1``
        for padding: how a forward wrapper maps per-token data (routed experts) to this rank's
        tokens. Sequence parallelism then gives tensor-parallel rank ``i`` the ``i``-th of ``tp``
        equal slices of these ``n`` tokens inside MoE layers.
    :ivar shape: ``(b, t)`` of the micro-batch.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    bounds: list[int]
    max_seqlen: int
    hidden_index: torch.Tensor
    target_ids: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    token_index: torch.Tensor
    shape: tuple[int, int]

    def token_positions(self, sequence_parallel: int = 1, rank: int = 0) -> torch.Tensor:
        """``[N]`` flat index ``row * t + col`` into the micro-batch of each token the MoE routers
        see, in their order, ``-1`` for padding (``ForwardContext.state["token_positions"]``).
        Under sequence parallelism over ``sequence_parallel`` ranks, tensor-parallel rank ``rank``
        routes the ``rank``-th equal slice of this rank's tokens."""
        row, col = self.token_index.unbind(1)
        flat = torch.where(row >= 0, row * self.shape[1] + col, torch.full_like(row, -1))
        return flat.chunk(sequence_parallel)[rank] if sequence_parallel > 1 else flat

    def packed_seq_params(self, cp_group: Any = None, rope_angles: torch.Tensor | None = None) -> Any:
        """megatron-core's THD parameters, plus the host ``bounds`` and, when the model's rotary
        embedding is applied in core attention (:mod:`miles_megatron.rope`), each token's angles."""
        return _packed_params_class()(
            qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens, max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen, cp_group=cp_group, bounds=self.bounds, rope_angles=rope_angles,
        )

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """``[K]`` values of wanted tokens -> ``[b, t]`` (zero elsewhere); keeps autograd."""
        return values.new_zeros(self.shape).index_put((self.rows, self.cols), values)


@functools.cache
def _packed_params_class() -> type:
    from megatron.core.packed_seq_params import PackedSeqParams

    @dataclass
    class PackedRows(PackedSeqParams):
        """``PackedSeqParams`` with what TorchAttention reads besides: ``bounds`` (host ``cu_seqlens``),
        ``rope_angles [n, rotary_dim]`` and the ``cos``/``sin`` tables made from them, by dtype."""

        bounds: list[int] | None = None
        rope_angles: torch.Tensor | None = None
        rope_tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    return PackedRows


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def context_parallel_index(lengths: list[int], cp: int, rank: int) -> torch.Tensor:
    """Positions of the packed sequence that context-parallel ``rank`` holds: chunks ``rank`` and
    ``2 cp - 1 - rank`` of every row (rows already padded to a multiple of ``2 cp``)."""
    if cp == 1:
        return torch.arange(sum(lengths))
    parts, start = [], 0
    for length in lengths:
        chunk = length // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            parts.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
        start += length
    return torch.cat(parts)


def build(tokens: torch.Tensor, loss_mask: torch.Tensor, lengths: list[int], *, tp: int, cp: int, cp_rank: int,
          device: torch.device) -> MicroInputs:
    """Pack the rows of ``tokens [b, t]`` (``lengths`` real tokens each) for this rank.

    An empty micro-batch (``b == 0``) becomes one padding row: an idle rank still runs the
    forward and backward its collectives need, and contributes nothing.
    """
    b, t = tokens.shape
    unit = 2 * cp if cp > 1 else 1
    padded = [_round_up(n, unit) for n in lengths]
    total = sum(padded)
    tail = _round_up(max(total, 1), math.lcm(unit, cp * tp)) - total
    if tail:
        padded.append(tail)
    n = sum(padded)
    ids = torch.zeros(n, dtype=torch.long)
    positions = torch.zeros(n, dtype=torch.long)
    token_index = torch.full((n, 2), -1, dtype=torch.long)
    targets = torch.zeros(n, dtype=torch.long)
    wanted = torch.zeros(n, dtype=torch.bool)
    starts = [0]
    for row, length in enumerate(lengths):
        s = starts[-1]
        ids[s : s + length] = tokens[row, :length]
        positions[s : s + padded[row]] = torch.arange(padded[row])
        token_index[s : s + length, 0] = row
        token_index[s : s + length, 1] = torch.arange(length)
        # position p predicts token p + 1 of the same row
        targets[s : s + length - 1] = tokens[row, 1:length]
        wanted[s : s + length - 1] = loss_mask[row, 1:length] > 0
        starts.append(s + padded[row])
    if tail:
        positions[n - tail :] = torch.arange(tail)
    bounds = [0, *torch.tensor(padded).cumsum(0).tolist()]
    cu = torch.tensor(bounds, dtype=torch.int32)

    local = context_parallel_index(padded, cp, cp_rank)
    local_wanted = wanted[local]
    hidden_index = torch.nonzero(local_wanted, as_tuple=True)[0]
    source = local[hidden_index]  # packed positions of the predicting tokens
    rows, cols = token_index[source, 0], token_index[source, 1] + 1

    def dev(x: torch.Tensor) -> torch.Tensor:
        return x.to(device, non_blocking=True)

    return MicroInputs(
        input_ids=dev(ids[local][None]), position_ids=dev(positions[local][None]), cu_seqlens=dev(cu), bounds=bounds,
        max_seqlen=max(padded), hidden_index=dev(hidden_index), target_ids=dev(targets[source]),
        rows=dev(rows), cols=dev(cols), token_index=dev(token_index[local]), shape=(b, t),
    )
