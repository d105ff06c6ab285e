"""Packing a micro-batch into one sequence (the plan of micro-batches is
:mod:`miles_algorithms.planning`'s, shared with the other backends).

FSDP runs collectives inside each forward and backward, so all ranks must run the same number of
micro-batches; a rank out of rows runs a one-token dummy whose loss is multiplied by zero.

Packing puts the ``n_r`` real tokens of each row ``r`` one after the other in a ``[1, N]`` sequence
with position ids restarting at 0 for each row. transformers turns restarting position ids (with
``attention_mask=None``) into a block-diagonal causal mask, so rows never attend to each other; the
packed and padded paths give the same log-probs (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from miles_algorithms.planning import (
    RankPlan,
    pack_by_budget,
    plan_micro_batches,
    row_lengths,
    split_rows_evenly,
)

if TYPE_CHECKING:
    import torch
    from miles_contracts import TrainBatch
    from torch.nn.attention.flex_attention import BlockMask

__all__ = ["ModelInputs", "RankPlan", "build_inputs", "dummy_inputs", "pack_by_budget", "plan_micro_batches",
           "row_lengths", "split_rows_evenly"]


@dataclass(slots=True)
class ModelInputs:
    """What one forward pass of a micro-batch needs, on the model's device.

    :ivar input_ids: ``[1, N]`` packed tokens, or ``[b, t]`` padded rows.
    :ivar position_ids: same shape; restarts at 0 for each packed row.
    :ivar attention_mask: ``[b, t]`` for the padded layout, None when packed; for a prefix tree
        (:mod:`miles_fsdp.prefix_tree`) the tree mask, ``[1, 1, N, N]`` or a flex ``BlockMask``.
    :ivar hidden_index: ``[K]`` flat index into the ``[*, H]`` hidden states (flattened over the
        leading dims) of the position that predicts each wanted token.
    :ivar target_ids: ``[K]`` the wanted tokens.
    :ivar rows: ``[K]`` row (in the micro-batch) of each wanted token.
    :ivar cols: ``[K]`` column ``t`` of each wanted token (its position in its row).
    :ivar shape: ``(b, t)`` of the micro-batch, for scattering results back to ``[b, t]``.
    :ivar cu_seqlens: ``[b + 1]`` start offsets of packed rows (packed layout only), for plugins.
    :ivar seen_positions: ``[N]`` what :meth:`token_positions` returns, when the layout sets it (a
        prefix tree: a node shared by several rows maps to the first of them).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | BlockMask | None
    hidden_index: torch.Tensor
    target_ids: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    shape: tuple[int, int]
    cu_seqlens: torch.Tensor | None = None
    seen_positions: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens the model computes (padding excluded)."""
        if self.attention_mask is None or self.seen_positions is not None:
            return int(self.input_ids.numel())
        return int(cast("torch.Tensor", self.attention_mask).sum())  # the padded layout's [b, t] mask

    def token_positions(self) -> torch.Tensor:
        """``[N]`` flat index ``b * t + col`` into the micro-batch of each token the model sees, in
        the order it sees them; -1 for padding (``ForwardContext.state["token_positions"]``)."""
        import torch

        if self.seen_positions is not None:
            return self.seen_positions
        b, t = self.shape
        if self.attention_mask is None:  # packed: rows one after the other, no padding
            starts = self.cu_seqlens if self.cu_seqlens is not None else torch.tensor([0, self.input_ids.shape[-1]])
            lengths = (starts[1:] - starts[:-1]).tolist()
            return torch.cat([torch.arange(n) + row * t for row, n in enumerate(lengths)]).to(self.input_ids.device)
        padding = cast("torch.Tensor", self.attention_mask)  # the padded layout's [b, t] mask
        flat = torch.arange(b * t, device=padding.device)
        return torch.where(padding.reshape(-1) > 0, flat, torch.full_like(flat, -1))

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """``[K]`` per-wanted-token values -> ``[b, t]`` (zero elsewhere); keeps autograd."""
        out = values.new_zeros(self.shape)
        return out.index_put((self.rows, self.cols), values)


def build_inputs(micro: TrainBatch, *, packed: bool, device: torch.device) -> ModelInputs:
    """Model inputs that predict every ``loss_mask`` position of ``micro`` (a padded batch).

    Entry ``[r, t]`` of the batch is token ``t`` predicted from tokens ``:t``, so its logit comes
    from the hidden state at position ``t - 1``; column 0 is never predicted.
    """
    import torch

    if bool((micro.loss_mask[:, 0] > 0).any()):
        raise ValueError("loss_mask[:, 0] must be 0: the first token of a row has no context to be predicted from")
    if bool(((micro.loss_mask > 0) & (micro.attention_mask == 0)).any()):
        raise ValueError("loss_mask is non-zero on padding (attention_mask 0); the loss mask must lie inside each row")
    lengths = row_lengths(micro.attention_mask)
    b, t = micro.tokens.shape
    rows, cols = torch.nonzero(micro.loss_mask > 0, as_tuple=True)  # row-major order
    target_ids = micro.tokens[rows, cols]
    if packed:
        starts = torch.tensor([0, *lengths], dtype=torch.long).cumsum(0)
        input_ids = torch.cat([micro.tokens[r, :n] for r, n in enumerate(lengths)])[None, :]
        position_ids = torch.cat([torch.arange(n) for n in lengths])[None, :]
        hidden_index = starts[rows] + cols - 1
        attention_mask = None
        cu_seqlens = starts
    else:
        input_ids = micro.tokens
        position_ids = torch.arange(t)[None, :].expand(b, t)
        hidden_index = rows * t + cols - 1
        attention_mask = micro.attention_mask
        cu_seqlens = None

    def dev(x: torch.Tensor) -> torch.Tensor:
        return x.to(device, non_blocking=True)

    return ModelInputs(
        input_ids=dev(input_ids), position_ids=dev(position_ids),
        attention_mask=None if attention_mask is None else dev(attention_mask),
        hidden_index=dev(hidden_index), target_ids=dev(target_ids), rows=dev(rows), cols=dev(cols),
        shape=(b, t), cu_seqlens=cu_seqlens,
    )


def dummy_inputs(device: torch.device, token_id: int = 0) -> ModelInputs:
    """A one-row, two-token input with one wanted token: keeps an idle rank in FSDP's lockstep."""
    import torch

    ids = torch.full((1, 2), token_id, dtype=torch.long, device=device)
    one = torch.ones(1, dtype=torch.long, device=device)
    return ModelInputs(
        input_ids=ids, position_ids=torch.arange(2, device=device)[None, :], attention_mask=None,
        hidden_index=one - 1, target_ids=one * token_id, rows=one - 1, cols=one, shape=(1, 2),
        cu_seqlens=torch.tensor([0, 2]),
    )
