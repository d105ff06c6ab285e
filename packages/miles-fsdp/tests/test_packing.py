"""Planning micro-batches over ranks and packing rows: every row once, lockstep counts, exact indices."""

from __future__ import annotations

import pytest
import torch
from miles_contracts.testing.backend import make_test_batch
from miles_fsdp.packing import (
    build_inputs,
    pack_by_budget,
    plan_micro_batches,
    row_lengths,
    split_rows_evenly,
)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("budget", [1, 10, 25, 1000])
def test_plan_covers_every_row_once_with_equal_counts(world: int, budget: int) -> None:
    lengths = [12, 7, 16, 5, 9, 3, 3, 20]
    plan = plan_micro_batches(lengths, budget, world)
    assert len(plan) == world
    assert len({len(p) for p in plan}) == 1, "ranks must run the same number of micro-batches"
    rows = sorted(r for rank in plan for micro in rank for r in micro)
    assert rows == list(range(len(lengths)))
    for rank in plan:
        for micro in rank:
            if len(micro) > 1:
                assert sum(lengths[r] for r in micro) <= budget


def test_more_ranks_than_rows_gives_idle_ranks_dummy_micro_batches() -> None:
    plan = plan_micro_batches([5], 100, 3)
    assert plan[0] == [[0]] and plan[1] == [[]] and plan[2] == [[]]


def test_split_keeps_rows_of_one_rollout_together_and_balances_tokens() -> None:
    lengths = [10, 10, 4, 4, 6, 6]
    keys = [0, 0, 1, 1, 2, 3]
    groups = split_rows_evenly(lengths, 2, keys)
    where = {r: g for g, rows in enumerate(groups) for r in rows}
    assert where[0] == where[1] and where[2] == where[3]
    loads = [sum(lengths[r] for r in rows) for rows in groups]
    assert sorted(loads) == [20, 20]


def test_a_row_longer_than_the_budget_gets_its_own_micro_batch() -> None:
    assert pack_by_budget([0, 1, 2], [50, 3, 4], 10) == [[0], [1, 2]]


def test_row_lengths_rejects_masks_with_holes() -> None:
    assert row_lengths(torch.tensor([[1, 1, 0], [1, 1, 1]])) == [2, 3]
    with pytest.raises(ValueError, match="right-padded"):
        row_lengths(torch.tensor([[1, 0, 1]]))


@pytest.mark.parametrize("packed", [True, False])
def test_inputs_point_at_the_predicting_position(tiny_dense, packed: bool) -> None:
    batch = make_test_batch(tiny_dense, lengths=(6, 3, 5), prompt=2)
    inputs = build_inputs(batch, packed=packed, device=torch.device("cpu"))
    flat_ids = inputs.input_ids.reshape(-1)
    # the token at the predicting position is the one just before the target in the same row
    assert torch.equal(flat_ids[inputs.hidden_index + 1], inputs.target_ids)
    assert torch.equal(batch.tokens[inputs.rows, inputs.cols], inputs.target_ids)
    assert int(inputs.target_ids.numel()) == int((batch.loss_mask > 0).sum())
    if packed:
        assert inputs.input_ids.shape == (1, 14) and inputs.cu_seqlens.tolist() == [0, 6, 9, 14]
        assert inputs.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1, 2, 3, 4]


@pytest.mark.parametrize("packed", [True, False])
def test_token_positions_map_what_the_model_sees_back_to_the_batch(tiny_dense, packed: bool) -> None:
    batch = make_test_batch(tiny_dense, lengths=(6, 3, 5), prompt=2)
    inputs = build_inputs(batch, packed=packed, device=torch.device("cpu"))
    positions = inputs.token_positions()
    seen = inputs.input_ids.reshape(-1)
    assert positions.shape == seen.shape
    real = positions >= 0
    assert torch.equal(batch.tokens.reshape(-1)[positions[real]], seen[real])
    assert int(real.sum()) == int(batch.attention_mask.sum())  # every real token once, padding -1


def test_loss_mask_on_the_first_column_or_on_padding_is_refused(tiny_dense) -> None:
    batch = make_test_batch(tiny_dense, lengths=(4, 2), prompt=1)
    batch.loss_mask[0, 0] = 1
    with pytest.raises(ValueError, match="first token"):
        build_inputs(batch, packed=True, device=torch.device("cpu"))
    batch.loss_mask[0, 0] = 0
    batch.loss_mask[1, 3] = 1
    with pytest.raises(ValueError, match="padding"):
        build_inputs(batch, packed=True, device=torch.device("cpu"))


def test_micro_batches_are_packed_only_when_that_is_cheaper() -> None:
    import torch
    from miles_fsdp.passes import attention_pair_cost, worth_packing

    smollm2 = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}
    cost = attention_pair_cost(smollm2)
    # by hand: 2 * 4 * 576 / (2 * (576 * 960 + 576 * 576 + 3 * 576 * 1536))
    assert cost == pytest.approx(8 * 576 / (2 * (576 * 960 + 576 * 576 + 3 * 576 * 1536)))
    assert attention_pair_cost({"hidden_size": None}) == pytest.approx(1e-3)  # unreadable config: the default

    equal = torch.ones(4, 4096, dtype=torch.long)  # long equal rows: padded, fused causal attention
    assert not worth_packing(equal, cost)
    many_short = torch.zeros(256, 80, dtype=torch.long)  # an RL step of short rollouts: a dense N^2 mask loses
    for row in range(256):
        many_short[row, : 40 + row % 41] = 1
    assert not worth_packing(many_short, cost)
    one_long = torch.zeros(4, 4096, dtype=torch.long)  # one long row and three short: packing saves 3 x 4K
    for row, n in enumerate([4096, 100, 100, 100]):
        one_long[row, :n] = 1
    assert worth_packing(one_long, cost)
    ragged = torch.zeros(4, 100, dtype=torch.long)
    for row, n in enumerate([100, 20, 30, 40]):
        ragged[row, :n] = 1
    assert worth_packing(ragged, cost)
    assert not worth_packing(ragged[:1], cost)  # one row: nothing to pack
