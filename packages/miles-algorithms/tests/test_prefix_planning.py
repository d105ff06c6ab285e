"""Prefix-aware micro-batch planning: rows that share a prefix are planned together, budgeted by tree size."""

from __future__ import annotations

import random
import struct
from collections import Counter

import pytest
from miles_algorithms.planning import (
    common_prefix_length,
    pack_by_budget,
    plan_micro_batches,
    plan_prefix_micro_batches,
    tree_load,
)


def _groups(count: int, prompt: int, samples: int, completion: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """GRPO groups (own prompt each), rows shuffled; returns (keys, group of each row)."""
    rng = random.Random(seed)
    rows = []
    for g in range(count):
        head = [rng.randrange(1, 50_000) for _ in range(prompt)]
        rows += [(head + [rng.randrange(1, 50_000) for _ in range(completion)], g) for _ in range(samples)]
    rng.shuffle(rows)
    return [r for r, _ in rows], [g for _, g in rows]


def _every_row_once(plans: list[list[list[int]]], n: int) -> None:
    seen = sorted(r for plan in plans for micro in plan for r in micro)
    assert seen == list(range(n))


def test_common_prefix_length_matches_a_plain_scan() -> None:
    rng = random.Random(1)
    for _ in range(300):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        b = a[: rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 10))]
        want = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        assert common_prefix_length(a, b) == want


def test_tree_load_counts_a_shared_prefix_once() -> None:
    keys = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4], [7]]  # row 2 duplicates row 0: no new node
    load = tree_load(keys, [0, 1, 2, 3])
    assert load.nodes == 4 + 1 + 0 + 1
    # pairs: every node attends to its depth + 1 ancestors-or-self
    assert load.pairs == (1 + 2 + 3 + 4) + 3 + 0 + 1


def test_groups_stay_whole_and_fill_the_budget_by_tree_nodes() -> None:
    keys, group = _groups(count=4, prompt=64, samples=8, completion=16)
    tree_of_group = 64 + 8 * 16  # 192 nodes, 640 flat tokens
    plan, = plan_prefix_micro_batches(keys, token_budget=2 * tree_of_group, world_size=1)
    assert len(plan) == 2
    for micro in plan:
        assert tree_load(keys, micro).nodes <= 2 * tree_of_group
        groups = {group[r] for r in micro}
        assert len(groups) == 2 and all(sum(group[r] == g for r in micro) == 8 for g in groups)
    # the prefix-blind planner counts flat tokens: 4 of the 80-token rows per micro-batch, 8 passes
    flat, = plan_micro_batches([len(k) for k in keys], 2 * tree_of_group, 1)
    assert len(flat) == 8


def test_tokens_as_fixed_width_bytes_plan_the_same_groups() -> None:
    """The fsdp runner passes each row as its int64 bytes (a different but valid trie order)."""
    def as_bytes(rows: list[list[int]]) -> list[bytes]:
        return [struct.pack(f"<{len(r)}q", *r) for r in rows]

    # 258 and 2 share their low byte: the shared prefix is counted in whole tokens
    mid_token = [[1, 2, 3], [1, 258, 3]]
    assert common_prefix_length(*as_bytes(mid_token)) == 9
    assert tree_load(as_bytes(mid_token), [0, 1], item_size=8).nodes == tree_load(mid_token, [0, 1]).nodes == 5
    keys, group = _groups(count=4, prompt=64, samples=8, completion=16, seed=5)
    assert tree_load(as_bytes(keys), range(32), item_size=8).nodes == tree_load(keys, range(32)).nodes == 4 * 192
    plan, = plan_prefix_micro_batches(as_bytes(keys), token_budget=2 * 192, world_size=1, item_size=8)
    assert [sorted(Counter(group[r] for r in micro).values()) for micro in plan] == [[8, 8], [8, 8]]


def test_ranks_get_whole_groups_and_the_same_number_of_micro_batches() -> None:
    keys, group = _groups(count=6, prompt=40, samples=4, completion=10, seed=2)
    plans = plan_prefix_micro_batches(keys, token_budget=80, world_size=2)
    _every_row_once(plans, len(keys))
    assert len(plans[0]) == len(plans[1])
    groups_of_rank = [{group[r] for micro in plan for r in micro} for plan in plans]
    assert not groups_of_rank[0] & groups_of_rank[1]  # no group split over ranks
    assert len(groups_of_rank[0]) == len(groups_of_rank[1]) == 3


def test_a_dense_mask_cost_keeps_big_unrelated_trees_apart() -> None:
    keys, group = _groups(count=3, prompt=2048, samples=8, completion=256, seed=3)
    pair_cost = 1 / 1900

    def dense(nodes: int, pairs: int) -> float:
        return nodes + pair_cost * nodes * nodes

    def sparse(nodes: int, pairs: int) -> float:
        return nodes + pair_cost * pairs

    budget = 3 * (2048 + 8 * 256)
    plan, = plan_prefix_micro_batches(keys, budget, 1, cost=dense)
    assert sorted(len({group[r] for r in micro}) for micro in plan) == [1, 1, 1]  # one group per pass
    plan, = plan_prefix_micro_batches(keys, budget, 1, cost=sparse)
    assert len(plan) == 1  # block-sparse attention: the three trees share one pass


def test_micro_batches_marked_flat_are_packed_again_by_flat_tokens() -> None:
    keys, _ = _groups(count=2, prompt=30, samples=6, completion=20, seed=4)
    budget = 200
    plans = plan_prefix_micro_batches(keys, budget, 1, flat=lambda rows: True)
    _every_row_once(plans, len(keys))
    assert all(sum(len(keys[r]) for r in micro) <= budget for micro in plans[0])
    assert len(plans[0]) == len(pack_by_budget(list(range(len(keys))), [len(k) for k in keys], budget))


@pytest.mark.parametrize("seed", range(20))
def test_random_batches_plan_every_row_exactly_once_within_the_budget(seed: int) -> None:
    rng = random.Random(seed)
    stems = [[rng.randrange(1, 9) for _ in range(rng.randrange(1, 30))] for _ in range(4)]
    keys = [rng.choice(stems)[: rng.randrange(1, 30)] + [rng.randrange(1, 9) for _ in range(rng.randrange(0, 20))]
            for _ in range(rng.randrange(1, 40))]
    world, budget = rng.choice([1, 2, 3]), rng.randrange(20, 200)
    plans = plan_prefix_micro_batches(keys, budget, world)
    _every_row_once(plans, len(keys))
    assert len({len(p) for p in plans}) == 1
    for plan in plans:
        for micro in plan:  # a micro-batch over the budget is one row, or was split down to fit
            assert len(micro) <= 1 or tree_load(keys, micro).nodes <= budget


def test_a_budget_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="budget"):
        plan_prefix_micro_batches([[1, 2]], 0, 1)
