"""``rollout.true_on_policy_check``: the first differing token fails the step by step, sample and
response position (error), or differing tokens are counted (metric); fsdp settings that break the
invariant forward are refused together."""

from __future__ import annotations

import pytest
import torch
from miles_contracts import TrainBatch
from miles_fsdp.config import FSDPSection
from miles_fsdp.on_policy import OnPolicyCheck, OnPolicyMismatch, incompatible_options


def _batch() -> TrainBatch:
    loss_mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.float32)
    rollout = torch.tensor([[0, 0, -1.5, -2.0, -0.25], [0, -3.0, -1.0, 0, 0]])
    return TrainBatch(tokens=torch.arange(10).reshape(2, 5), attention_mask=torch.ones(2, 5, dtype=torch.long),
                      loss_mask=loss_mask, rollout_logprobs=rollout, rewards=torch.zeros(2),
                      group_ids=torch.zeros(2, dtype=torch.long), rollout_ids=torch.tensor([40, 41]))


def test_equal_logprobs_pass_and_are_counted():
    check = OnPolicyCheck("error")
    check.start_step(3)
    batch = _batch()
    check.check(batch.rollout_logprobs.clone(), batch)
    assert check.metrics() == {"true_on_policy_checked_tokens": 5.0, "true_on_policy_mismatched_tokens": 0.0}


def test_error_names_step_sample_and_position_of_the_first_differing_token():
    batch = _batch()
    trainer = batch.rollout_logprobs.clone()
    trainer[0, 3] = torch.nextafter(trainer[0, 3], torch.tensor(0.0))  # one ulp off
    trainer[1, 0] = 9.0  # outside the loss mask: not compared
    check = OnPolicyCheck("error")
    check.start_step(7)
    with pytest.raises(OnPolicyMismatch, match=r"step 7, sample 40 \(batch row 0\), response token 1 \(column 3"):
        check.check(trainer, batch)
    counting = OnPolicyCheck("metric")
    counting.check(trainer, batch)
    assert counting.metrics()["true_on_policy_mismatched_tokens"] == 1.0


def test_fsdp_settings_that_break_the_invariant_forward_are_all_named():
    errors = incompatible_options(FSDPSection(compile=True, prefix_tree="on", logprob_temperature=1.0),
                                  rollout_temperature=0.8)
    assert len(errors) == 3
    assert "fsdp.logprob_temperature" in errors[0] and "fsdp.compile" in errors[1] and "fsdp.prefix_tree" in errors[2]
    assert incompatible_options(FSDPSection(), rollout_temperature=0.8) == []
    # the same temperature, or 1.0 for a greedy rollout, is what the engine used
    assert incompatible_options(FSDPSection(logprob_temperature=0.8), rollout_temperature=0.8) == []
    assert incompatible_options(FSDPSection(logprob_temperature=1.0), rollout_temperature=0.0) == []


def test_the_backend_marks_exactly_the_forwards_that_run_with_the_rollout_weights(tiny_dense):
    """``ForwardContext.state["true_on_policy_step"]`` (what the r3 plugin checks routing in): the
    old-policy pass and the first update's forward of a step carry the step; the second update's
    forward (weights moved since the rollout) does not; the next step's forwards carry the next step."""
    import dataclasses

    from miles.config import MilesConfig
    from miles.context import context_for
    from miles.sections import ModelSection, RolloutSection, RunSection, TrainSection
    from miles_contracts import Process
    from miles_fsdp.backend import FSDPBackend

    config = MilesConfig(model=ModelSection(name=str(tiny_dense), device="cpu"), run=RunSection(steps=2),
                         rollout=RolloutSection(temperature=1.0, true_on_policy=True),
                         train=TrainSection(lr=1e-3, updates_per_step=2), extra={"fsdp": FSDPSection()})
    backend = FSDPBackend(context_for(config, Process.trainer_rank(0)))
    seen: list[tuple[str, int | None]] = []
    marks = backend.runner.on_policy_step

    def recording(phase, module):
        seen.append((phase, marks(phase, module)))
        return seen[-1][1]

    backend.runner.on_policy_step = recording
    try:
        tokens = torch.randint(3, 1000, (2, 8), generator=torch.Generator().manual_seed(0))
        loss_mask = torch.tensor([[0.0] * 4 + [1.0] * 4, [0.0] * 5 + [1.0] * 3])
        batch = TrainBatch(tokens=tokens, attention_mask=torch.ones(2, 8, dtype=torch.long), loss_mask=loss_mask,
                           rollout_logprobs=torch.zeros(2, 8), rewards=torch.tensor([1.0, 0.0]),
                           group_ids=torch.zeros(2, dtype=torch.long), rollout_ids=torch.tensor([0, 1]))
        batch = dataclasses.replace(batch, rollout_logprobs=backend.compute_logprobs(batch),
                                    advantages=loss_mask * torch.tensor([[1.0], [-1.0]]))
        assert seen == [("old_logprobs", 1)]
        seen.clear()
        backend.train_step(batch)  # two updates of one row each, the old-policy pass first
        assert seen[0] == ("old_logprobs", 1) and seen[-1] == ("train", None)
        assert [step for phase, step in seen if phase == "train"] == [1, None]
        seen.clear()
        backend.compute_logprobs(batch)
        assert seen == [("old_logprobs", 2)]
    finally:
        backend.close()
