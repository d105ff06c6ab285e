"""Planning the micro-batches of a training step: rows over data-parallel ranks, then packed by
token budget. Shared by the train backends (``miles-fsdp``, ``miles-megatron``).

Every rank receives the same full batch, so every rank computes the same plan without talking to
the others. Backends run collectives inside each forward and backward, so all ranks must run the
same number of micro-batches: ranks with less work split their micro-batches further, or, when
they run out of rows, run an empty one (a dummy that contributes zero).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
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


def _halve_evenly(rows: list[int], lengths: Sequence[int]) -> list[list[int]]:
    return [[rows[k] for k in half] for half in split_rows_evenly([lengths[r] for r in rows], 2)]


def _split_to_count(plan: RankPlan, lengths: Sequence[int], count: int,
                    halve: Callable[[list[int]], list[list[int]]] | None = None) -> RankPlan:
    """Split the heaviest splittable micro-batch (by ``halve``: two halves of similar token count
    by default) until there are ``count``; pad with dummies."""
    plan = [list(b) for b in plan]
    while len(plan) < count:
        splittable = [i for i, b in enumerate(plan) if len(b) > 1]
        if not splittable:
            plan.append([])
            continue
        i = max(splittable, key=lambda j: (sum(lengths[r] for r in plan[j]), -j))
        plan[i : i + 1] = halve(plan[i]) if halve is not None else _halve_evenly(plan[i], lengths)
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


# ----------------------------------------------------------------------------- prefix-aware planning

Key = bytes | list[int]
"""A row's real tokens for prefix planning: a list of ids, or their fixed-width bytes
(``item_size`` bytes a token; any fixed-width encoding sorts rows into a valid trie preorder, and
``bytes`` sort and compare at C speed, where a batch's ``tolist()`` alone costs ~0.1 s per 1M tokens)."""


def common_prefix_length(a: Sequence[int] | bytes, b: Sequence[int] | bytes) -> int:
    """Length of the longest common prefix of two sequences (binary search over slice compares)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _triangle(n: int) -> int:
    return n * (n + 1) // 2


@dataclass(slots=True)
class TreeLoad:
    """The prefix tree of a micro-batch's rows in trie preorder, as counts: ``nodes`` (tokens the
    layers compute, a shared prefix once) and ``pairs`` (``(query, key)`` pairs the tree mask allows:
    each node attends to itself and its ancestors, i.e. ``depth + 1`` keys)."""

    item_size: int = 1
    nodes: int = 0
    pairs: int = 0
    last: Key | None = None

    def added(self, key: Key) -> tuple[int, int]:
        """``(nodes, pairs)`` the row ``key`` adds after the rows so far (it follows them in preorder)."""
        n = len(key) // self.item_size
        shared = 0 if self.last is None else common_prefix_length(self.last, key) // self.item_size
        return n - shared, _triangle(n) - _triangle(shared)

    def add(self, key: Key) -> None:
        nodes, pairs = self.added(key)
        self.nodes, self.pairs, self.last = self.nodes + nodes, self.pairs + pairs, key

    def start(self, key: Key) -> None:
        """Reset to the tree of ``key`` alone."""
        self.nodes, self.pairs, self.last = 0, 0, None
        self.add(key)


def _preorder(keys: Sequence[Key], rows: Sequence[int]) -> list[int]:
    return sorted(rows, key=lambda r: keys[r])  # lexicographic order = trie preorder


def tree_load(keys: Sequence[Key], rows: Sequence[int], item_size: int = 1) -> TreeLoad:
    """:class:`TreeLoad` of ``rows`` (indices into ``keys``, the rows' real tokens)."""
    load = TreeLoad(item_size)
    for row in _preorder(keys, rows):
        load.add(keys[row])
    return load


# What one more micro-batch (a forward and a backward) costs beyond its tokens, in tokens of matrix
# multiplies: a rough, deliberately low figure (launches and host work; on an H200 a Qwen3-0.6B
# micro-batch's fixed part is worth several thousand tokens, on CPU far less). It keeps small
# unrelated rows together instead of giving each its own pass.
MICRO_BATCH_OVERHEAD_TOKENS = 1024


def _fill_in_preorder(order: Sequence[int], keys: Sequence[Key], item_size: int, token_budget: int,
                      cost: Callable[[int, int], float]) -> RankPlan:
    """Rows (already in trie preorder) into consecutive micro-batches: a row joins the current one
    while its tree stays within ``token_budget`` nodes and joining costs no more than starting a
    new micro-batch with it (``cost(nodes, pairs)`` of a tree, plus :data:`MICRO_BATCH_OVERHEAD_TOKENS`
    for the new pass; a dense mask makes big trees dear, so there unrelated big subtrees part)."""
    plan: RankPlan = []
    load = TreeLoad(item_size)
    for row in order:
        key = keys[row]
        nodes, pairs = load.added(key)
        n = len(key) // item_size
        alone = cost(n, _triangle(n)) + MICRO_BATCH_OVERHEAD_TOKENS
        joined = cost(load.nodes + nodes, load.pairs + pairs) - cost(load.nodes, load.pairs)
        if plan and load.nodes + nodes <= token_budget and joined <= alone:
            plan[-1].append(row)
            load.add(key)
        else:
            plan.append([row])
            load.start(key)
    return plan


def _split_in_preorder(order: list[int], weights: Sequence[int], parts: int) -> list[list[int]]:
    """``parts`` consecutive runs of ``order`` of similar total weight (some may be empty)."""
    total = sum(weights[r] for r in order)
    runs: list[list[int]] = [[] for _ in range(parts)]
    seen = 0
    for row in order:
        # the run whose share of the total holds this row's midpoint
        part = min(parts - 1, int((seen + weights[row] / 2) * parts // max(total, 1)))
        runs[part].append(row)
        seen += weights[row]
    return runs


def plan_prefix_micro_batches(keys: Sequence[Key], token_budget: int, world_size: int, *, item_size: int = 1,
                              cost: Callable[[int, int], float] | None = None,
                              flat: Callable[[list[int]], bool] | None = None) -> list[RankPlan]:
    """:func:`plan_micro_batches` for prefix-tree training: rows that share a prefix stay together.

    ``keys[r]`` is row ``r``'s real tokens (:data:`Key`; ``item_size`` bytes a token for ``bytes``
    keys). The rows are sorted into trie preorder (rows with a common prefix are then adjacent)
    and cut into consecutive runs: one per rank, of similar tree size, then micro-batches of at
    most ``token_budget`` **tree nodes** (a shared prefix counts once), so a micro-batch holds as
    many GRPO groups or episode branches as its budget allows instead of splitting them by their
    flat size. ``cost(nodes, pairs)`` is a tree's cost (default: its nodes); a row starts a new
    micro-batch when joining would cost more than that.

    ``flat(rows)`` True marks a planned micro-batch that will run as flat rows after all (a tree
    that does not pay): a rank's such rows are packed again together by :func:`pack_by_budget`, so
    their flat tokens keep to the budget. Every rank gets the same number of micro-batches, as in
    :func:`plan_micro_batches`; splitting one to even the counts cuts it at the middle of its preorder.
    """
    if token_budget < 1:
        raise ValueError(f"micro-batch token budget must be >= 1, got {token_budget}")
    node_cost = cost if cost is not None else (lambda nodes, pairs: float(nodes))
    lengths = [len(k) // item_size for k in keys]
    order = _preorder(keys, range(len(keys)))
    added = [0] * len(keys)  # what each row adds to the whole batch's tree (after the row before it)
    load = TreeLoad(item_size)
    for row in order:
        added[row] = load.added(keys[row])[0]
        load.add(keys[row])
    plans: list[RankPlan] = []
    for rank_rows in _split_in_preorder(order, added, world_size):
        trees, flat_rows = [], []
        for micro in _fill_in_preorder(rank_rows, keys, item_size, token_budget, node_cost):
            if flat is not None and flat(micro):
                flat_rows.extend(micro)
            else:
                trees.append(micro)
        plans.append(trees + (pack_by_budget(flat_rows, lengths, token_budget) if flat_rows else []))
    count = max(1, max(len(p) for p in plans))

    def halve(rows: list[int]) -> list[list[int]]:  # at the middle of the micro-batch's preorder
        ranked = _preorder(keys, rows)
        half, seen, cut = sum(added[r] for r in ranked) / 2, 0, len(ranked) - 1
        for i, row in enumerate(ranked[:-1]):
            seen += added[row]
            if seen >= half:
                cut = i + 1
                break
        return [sorted(ranked[:cut]), sorted(ranked[cut:])]

    return [_split_to_count([sorted(m) for m in p], lengths, count, halve) for p in plans]
