"""TrainBatch layout: padding, alignment of per-token tensors, micro-batch selection."""

from __future__ import annotations

import pytest
import torch
from miles_contracts import Branch, Sample, Status, TrainBatch, bucketize


def _sample(index: int, prompt: list[int], response: list[int], reward: float) -> Sample:
    return Sample(tokens=prompt + response, response_length=len(response), loss_mask=[1] * len(response),
                  rollout_logprobs=[-0.5] * len(response), reward=reward, index=index, group_index=index // 2,
                  status=Status.COMPLETED)


def test_from_samples_pads_right_and_aligns_per_token_tensors() -> None:
    batch = TrainBatch.from_samples([_sample(0, [1, 2], [3, 4, 5], 1.0), _sample(1, [1], [9], 0.0)], pad_token_id=0)
    assert batch.tokens.tolist() == [[1, 2, 3, 4, 5], [1, 9, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # entry [b, t] is token t predicted from tokens[:t]: the response positions carry the mask
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    assert batch.rollout_logprobs[0, 2:].tolist() == [-0.5, -0.5, -0.5] and batch.rollout_logprobs[0, :2].sum() == 0
    assert batch.rewards.tolist() == [1.0, 0.0] and batch.group_ids.tolist() == [0, 0]
    assert batch.num_tokens == 7


def test_select_trims_columns_to_the_longest_selected_row() -> None:
    batch = TrainBatch.from_samples([_sample(0, [1, 2], [3, 4, 5], 1.0), _sample(1, [1], [9], 0.0)], pad_token_id=0)
    batch.extras["per_row"] = torch.tensor([7.0, 8.0])
    micro = batch.select([1])
    assert micro.tokens.tolist() == [[1, 9]] and micro.extras["per_row"].tolist() == [8.0]


def test_from_samples_rejects_an_invalid_sample_and_an_empty_batch() -> None:
    with pytest.raises(ValueError, match="zero samples"):
        TrainBatch.from_samples([], pad_token_id=0)
    bad = _sample(0, [1], [2, 3], 1.0)
    bad.loss_mask = [1]
    with pytest.raises(ValueError, match="loss_mask has 1 entries"):
        TrainBatch.from_samples([bad], pad_token_id=0)


def test_bucketize_respects_the_byte_budget_and_keeps_order() -> None:
    tensors = [(f"w{i}", torch.zeros(10, dtype=torch.float32)) for i in range(5)]  # 40 bytes each
    buckets = list(bucketize(tensors, bucket_bytes=100))
    assert [b.names for b in buckets] == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    assert [b.nbytes for b in buckets] == [80, 80, 40]
    big = list(bucketize([("huge", torch.zeros(100))], bucket_bytes=10))
    assert big[0].names == ["huge"]


def test_token_versions_follow_the_response_and_mark_what_no_engine_sampled() -> None:
    spanning = _sample(0, [1, 2], [3, 4, 5], 1.0)
    spanning.token_versions = [0, 0, 1]  # a trajectory that spans the update to version 1
    spanning.weight_versions = [0, 1]
    one_call = _sample(1, [1], [9, 8], 0.0)
    one_call.loss_mask = [0, 1]  # its first response token is a tool result
    one_call.weight_versions = [3]
    batch = TrainBatch.from_samples([spanning, one_call], pad_token_id=0)
    assert batch.token_versions.tolist() == [[-1, -1, 0, 0, 1], [-1, -1, 3, -1, -1]]
    assert batch.select([0]).token_versions.tolist() == [[-1, -1, 0, 0, 1]]
    assert TrainBatch.from_samples([_sample(2, [1], [2], 0.0)], pad_token_id=0).token_versions is None
    bad = _sample(3, [1], [2, 3], 1.0)
    bad.token_versions = [0]
    with pytest.raises(ValueError, match="token_versions has 1 entries"):
        TrainBatch.from_samples([bad], pad_token_id=0)


def _branch_row(index: int, group: int, role: str, branch_id: int, reward: float) -> Sample:
    row = _sample(index, [1, 2], [3 + branch_id], reward)
    row.group_index, row.branch = group, Branch(episode_id=f"e{index}", branch_id=branch_id, role=role,
                                                cause="root" if branch_id == 0 else "compaction")
    return row


def test_rows_of_one_episode_and_role_are_one_rollout_and_groups_are_per_role() -> None:
    """Two episodes of one prompt group, each with solver and critic branches (two solver
    branches each): one rollout per (episode, role), one advantage group per (group, role)."""
    rows = [_branch_row(index, 7, role, branch_id, reward)
            for index in (40, 41)
            for branch_id, role, reward in ((0, "solver", 1.0), (1, "critic", 0.0), (2, "solver", 1.0), (3, "critic", 0.0))]
    batch = TrainBatch.from_samples(rows, pad_token_id=0)
    assert batch.rollout_ids.tolist() == [0, 1, 0, 1, 2, 3, 2, 3]
    assert batch.group_ids.tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    linear = TrainBatch.from_samples([_sample(40, [1], [2], 1.0), _sample(43, [1], [2], 1.0)], pad_token_id=0)
    assert linear.rollout_ids.tolist() == [40, 43] and linear.group_ids.tolist() == [20, 21]  # as before branches


def test_a_row_without_a_branch_beside_branch_rows_is_a_rollout_of_its_own() -> None:
    rows = [_branch_row(5, 2, "solver", 0, 1.0), _sample(5, [1], [2], 1.0), _branch_row(5, 2, "solver", 1, 1.0)]
    rows[1].group_index = 2
    batch = TrainBatch.from_samples(rows, pad_token_id=0)
    assert batch.rollout_ids.tolist() == [0, 1, 0] and batch.group_ids.tolist() == [0, 1, 0]
