"""Planning the micro-batches of a training step: rows over data-parallel ranks, then packed by
token budget. Shared by the train backends (``miles-fsdp``, ``miles-megatron``).

Every rank receives the same full batch, so every rank computes the same plan without talking to
the others. Backends run collectives inside each forward and backward, so all ranks must run the
same number of micro-batches: ranks with less work split their micro-batches further, or, when
they run out of rows, run an empty one (a dummy that contributes zero).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

RankPlan = list[list[int]]  # micro-batches of one rank, each a list of row indices ([] = dummy)


def row_lengths(attention_mask: torch.Tensor) -> list[int]:
    """Real tokens per row of a right-padded ``[B, T]`` mask; rejects masks with holes."""
    lengths = attention_mask.sum(dim=1)
    width = attention_mask.shape[1]
    expected = (attention_mask.new_ones(width).cumsum(0)[None, :] <= lengths[:, None]).to(attention_mask.dtype)
    if not bool((expected == attention_mask).all()):
        raise ValueError(
            "attention_mask must be right-padded (1s then 0s in every row); "
            "build the batch with TrainBatch.from_samples, which pads on the right"
        )
    return [int(n) for n in lengths.tolist()]


def split_rows_evenly(lengths: Sequence[int], parts: int, keys: Sequence[int] | None = None) -> list[list[int]]:
    """Split row indices into ``parts`` groups of similar token count, keeping equal ``keys`` together.

    Rows that share a key (pieces of one rollout) stay in one group, so a reduction that counts a
    rollout once still sees all of it. Greedy largest-first onto the lightest group; deterministic.
    """
    units: dict[int, list[int]] = {}
    for row in range(len(lengths)):
        units.setdefault(keys[row] if keys is not None else row, []).append(row)
    ordered = sorted(units.values(), key=lambda rows: (-sum(lengths[r] for r in rows), rows[0]))
    groups: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for rows in ordered:
        target = min(range(parts), key=lambda g: (loads[g], g))
        groups[target].extend(rows)
        loads[target] += sum(lengths[r] for r in rows)
    return [sorted(g) for g in groups]


def pack_by_budget(rows: Sequence[int], lengths: Sequence[int], token_budget: int) -> RankPlan:
    """First-fit-decreasing of ``rows`` into micro-batches of at most ``token_budget`` tokens.

    A row longer than the budget gets a micro-batch of its own (it cannot be split: its tokens
    attend to each other).
    """
    bins: list[list[int]] = []
    loads: list[int] = []
    for row in sorted(rows, key=lambda r: (-lengths[r], r)):
        for i, load in enumerate(loads):
            if load + lengths[row] <= token_budget:
                bins[i].append(row)
                loads[i] += lengths[row]
                break
        else:
            bins.append([row])
            loads.append(lengths[row])
    return [sorted(b) for b in bins]


def _split_to_count(plan: RankPlan, lengths: Sequence[int], count: int) -> RankPlan:
    """Split the heaviest splittable micro-batch until there are ``count``; pad with dummies."""
    plan = [list(b) for b in plan]
    while len(plan) < count:
        splittable = [i for i, b in enumerate(plan) if len(b) > 1]
        if not splittable:
            plan.append([])
            continue
        i = max(splittable, key=lambda j: (sum(lengths[r] for r in plan[j]), -j))
        halves = split_rows_evenly([lengths[r] for r in plan[i]], 2)
        rows = plan[i]
        plan[i : i + 1] = [[rows[k] for k in half] for half in halves]
    return plan


def plan_micro_batches(lengths: Sequence[int], token_budget: int, world_size: int, *, multiple_of: int = 1) -> list[RankPlan]:
    """``plan[rank]``: the micro-batches (row lists) of each rank; every rank gets the same count
    (a multiple of ``multiple_of``: interleaved pipelines want one per stage)."""
    if token_budget < 1:
        raise ValueError(f"micro-batch token budget must be >= 1, got {token_budget}")
    per_rank = split_rows_evenly(lengths, world_size)
    plans = [pack_by_budget(rows, lengths, token_budget) for rows in per_rank]
    count = max(1, max(len(p) for p in plans))
    count = -(-count // multiple_of) * multiple_of
    return [_split_to_count(p, lengths, count) for p in plans]
