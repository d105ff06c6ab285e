"""The backend-facing objective: hand values, masked invariance, split rollouts, micro-batches."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from miles_algorithms.catalog import ADVANTAGE_SPECS
from miles_algorithms.corrections import CORRECTIONS
from miles_algorithms.estimators import GRPO, PPO
from miles_algorithms.losses import POLICY_LOSSES
from miles_algorithms.objective import (
    actor_loss,
    advantage_metrics,
    compute_advantages,
    critic_loss,
    kl_divergence,
    mismatch_metrics,
    prepare_batch,
    train_in_mini_batches,
)
from miles_algorithms.reductions import REDUCTIONS
from miles_contracts import AlgorithmParams, TrainBatch

NONE, TIS = CORRECTIONS["none"], CORRECTIONS["tis"]
PPO_CLIP = POLICY_LOSSES["ppo_clip"]


def two_rollouts(make_batch, **per_token):
    # one group, rewards 1 and 0: Dr.GRPO advantages +0.5 (2 tokens) and -0.5 (3 tokens)
    return make_batch([[0, 1, 1, 0], [0, 1, 1, 1]], rewards=[1.0, 0.0], **per_token)


def step(batch: TrainBatch, params: AlgorithmParams, estimator=None) -> TrainBatch:
    return prepare_batch(compute_advantages(batch, params, estimator or GRPO()))


def test_on_policy_loss_and_gradient_by_hand(make_batch):
    params = AlgorithmParams(normalize_std=False)
    batch = step(two_rollouts(make_batch), params)
    logprobs = torch.full((2, 4), -1.0, requires_grad=True)
    loss, metrics = actor_loss(logprobs, batch, params, policy_loss=PPO_CLIP, correction=NONE)
    # no old pass: ratio 1, loss = sum(-A) / N = -(2 * 0.5 - 3 * 0.5) / 5 = 0.1
    assert loss.item() == pytest.approx(0.1)
    assert metrics["pg_loss"] == pytest.approx(0.1) and metrics["loss"] == pytest.approx(0.1)
    assert metrics["pg_clipfrac"] == 0.0 and metrics["ratio"] == pytest.approx(1.0)
    loss.backward()
    # d loss / d logp_t = -A_t / N: -0.1 on row 0's tokens, +0.1 on row 1's, 0 elsewhere
    assert torch.allclose(logprobs.grad, torch.tensor([[0.0, -0.1, -0.1, 0.0], [0.0, 0.1, 0.1, 0.1]]))


def test_entropy_bonus_and_kl_loss_by_hand(make_batch):
    params = AlgorithmParams(normalize_std=False, entropy_coef=0.01, kl_loss_coef=0.5, kl_loss_estimator="k1")
    batch = step(two_rollouts(make_batch, ref_logprobs=[[0.0, -1.5, -1.0, 0.0], [0.0, -1.0, -1.5, -1.0]]), params)
    logprobs = torch.full((2, 4), -1.0, requires_grad=True)
    entropy = torch.tensor([[9.0, 1.0, 2.0, 9.0], [9.0, 3.0, 4.0, 5.0]])
    loss, metrics = actor_loss(logprobs, batch, params, policy_loss=PPO_CLIP, correction=NONE, entropy=entropy)
    # entropy mean (1 + 2 + 3 + 4 + 5) / 5 = 3; k1 = logp - ref: 0.5, 0 | 0, 0.5, 0 -> mean 0.2
    # loss = 0.1 - 0.01 * 3 + 0.5 * 0.2 = 0.17
    assert metrics["entropy"] == pytest.approx(3.0) and metrics["kl_loss"] == pytest.approx(0.2)
    assert loss.item() == pytest.approx(0.17) and metrics["loss"] == pytest.approx(0.17)


def test_truncated_importance_weights_scale_the_policy_loss(make_batch):
    params = AlgorithmParams(normalize_std=False, correction="tis", correction_high=2.0)
    old = [[0.0, -1.0, -1.0, 0.0], [0.0, -1.0, -1.0, -1.0]]
    # rollout log-prob ln4 below old on row 0's first token: weight 4, truncated to 2
    rollout = [[0.0, -1.0 - math.log(4), -1.0, 0.0], [0.0, -1.0, -1.0, -1.0]]
    batch = step(two_rollouts(make_batch, old_logprobs=old, rollout_logprobs=rollout), params)
    loss, metrics = actor_loss(torch.tensor(old), batch, params, policy_loss=PPO_CLIP, correction=TIS)
    # per-token -A: -0.5, -0.5 | 0.5 x3; weighted: -1.0, -0.5 | 0.5 x3 -> sum 0 -> loss 0
    assert loss.item() == pytest.approx(0.0, abs=1e-7)
    assert metrics["correction_clipfrac"] == pytest.approx(1 / 5)
    assert metrics["correction_weight"] == pytest.approx((2 + 1 * 4) / 5)


def random_batch(generator: torch.Generator, rows: int = 6, width: int = 9) -> TrainBatch:
    """Two groups, rollout 1 split over rows 1 and 2, masked tool spans, every optional field."""
    lengths = torch.randint(width - 3, width + 1, (rows,), generator=generator)
    attention = (torch.arange(width)[None, :] < lengths[:, None]).long()
    loss_mask = ((torch.rand(rows, width, generator=generator) < 0.7) & (torch.arange(width) >= 2) & (attention > 0)).float()
    loss_mask[:, -1] = torch.where(attention[:, -1] > 0, 1.0, 0.0)  # no empty row
    rollout_ids = torch.tensor([0, 1, 1, 2, 3, 4])[:rows]
    reward_of = torch.randn(5, generator=generator)
    rollout = -torch.rand(rows, width, generator=generator) * 2 * loss_mask
    old = rollout + 0.1 * torch.randn(rows, width, generator=generator)
    return TrainBatch(
        tokens=torch.randint(0, 100, (rows, width), generator=generator),
        attention_mask=attention,
        loss_mask=loss_mask,
        rollout_logprobs=rollout,
        rewards=reward_of[rollout_ids],
        group_ids=torch.tensor([0, 0, 0, 1, 1, 1])[:rows],
        rollout_ids=rollout_ids,
        old_logprobs=old,
        ref_logprobs=old + 0.1 * torch.randn(rows, width, generator=generator),
        teacher_logprobs=old + 0.1 * torch.randn(rows, width, generator=generator),
        values=torch.randn(rows, width, generator=generator),
    )


ALL_TERMS = dict(entropy_coef=0.01, kl_loss_coef=0.1, dual_clip_c=3.0, eps_clip_high=0.28, correction="tis",
                 correction_level="geometric", kl_coef=0.05, opd_coef=0.3)


@pytest.mark.parametrize("reduction", list(REDUCTIONS))
@pytest.mark.parametrize("loss_name", list(POLICY_LOSSES))
def test_micro_batches_sum_to_the_full_batch(reduction, loss_name):
    g = torch.Generator().manual_seed(7)
    params = AlgorithmParams(loss_reduction=reduction, **ALL_TERMS)
    batch = step(random_batch(g), params)
    leaf = (batch.old_logprobs + 0.2 * torch.randn(batch.old_logprobs.shape, generator=g)).requires_grad_(True)
    entropy = torch.rand(leaf.shape, generator=g)
    kwargs = dict(policy_loss=POLICY_LOSSES[loss_name], correction=TIS)
    full, full_metrics = actor_loss(leaf, batch, params, entropy=entropy, **kwargs)
    (full_grad,) = torch.autograd.grad(full, leaf)

    total, summed = torch.zeros(()), {}
    for rows in ([0, 3], [1, 5], [2], [4]):  # rollout 1's two rows land in different micro-batches
        micro = batch.select(rows)
        width = micro.tokens.shape[-1]
        loss, metrics = actor_loss(leaf[rows][:, :width], micro, params, entropy=entropy[rows][:, :width], **kwargs)
        loss.backward()
        total = total + loss.detach()
        summed = {k: summed.get(k, 0.0) + v for k, v in metrics.items()}
    assert torch.allclose(total, full.detach(), atol=1e-6)
    assert torch.allclose(leaf.grad, full_grad, atol=1e-6)
    assert summed == pytest.approx(full_metrics, abs=1e-6)


@pytest.mark.parametrize("reduction", list(REDUCTIONS))
def test_split_rollout_counts_once_in_the_loss(make_batch, reduction):
    # rollout 1 as one row (tokens 1-4) or split in two rows (tokens 1-2 and 3-4): same loss
    params = AlgorithmParams(loss_reduction=reduction, correction="tis", eps_clip=0.1)
    whole_mask = [[0, 1, 1, 0, 0], [0, 1, 1, 1, 1], [0, 1, 1, 1, 0]]
    split_mask = [[0, 1, 1, 0, 0], [0, 1, 1, 0, 0], [0, 0, 0, 1, 1], [0, 1, 1, 1, 0]]
    old_rows = [[0.0, -1.0, -2.0, 0.0, 0.0], [0.0, -0.5, -1.5, -0.2, -0.9], [0.0, -0.3, -0.6, -1.1, 0.0]]
    new_rows = [[0.0, -1.2, -1.8, 0.0, 0.0], [0.0, -0.4, -1.9, -0.1, -0.5], [0.0, -0.6, -0.6, -1.0, 0.0]]
    roll_rows = [[0.0, -1.1, -2.2, 0.0, 0.0], [0.0, -0.5, -1.2, -0.3, -0.9], [0.0, -0.3, -0.7, -1.0, 0.0]]
    pick = [0, 1, 1, 2]  # the split batch repeats rollout 1's row and masks each half

    def run(mask, rows, rollout_ids):
        rewards = {0: 1.0, 1: 0.0, 2: 0.5}  # per rollout: both halves of rollout 1 carry its reward
        batch = make_batch(
            mask, rewards=[rewards[r] for r in rollout_ids], rollout_ids=rollout_ids,
            old_logprobs=[old_rows[r] for r in rows], rollout_logprobs=[roll_rows[r] for r in rows],
        )
        batch = step(batch, params)
        logprobs = torch.tensor([new_rows[r] for r in rows], requires_grad=True)
        loss, _ = actor_loss(logprobs, batch, params, policy_loss=PPO_CLIP, correction=TIS)
        loss.backward()
        return loss, logprobs.grad

    whole, whole_grad = run(whole_mask, [0, 1, 2], [0, 1, 2])
    split, split_grad = run(split_mask, pick, [0, 1, 1, 2])
    assert torch.allclose(whole, split, atol=1e-7)
    merged = torch.stack([split_grad[0], split_grad[1] + split_grad[2], split_grad[3]])
    assert torch.allclose(whole_grad, merged, atol=1e-7)


@pytest.mark.parametrize("loss_name", list(POLICY_LOSSES))
def test_masked_positions_never_change_the_loss(loss_name):
    g = torch.Generator().manual_seed(3)
    params = AlgorithmParams(loss_reduction="sequence_mean", **ALL_TERMS)
    batch = step(random_batch(g), params)
    off = batch.loss_mask == 0
    logprobs = batch.old_logprobs + 0.3 * torch.randn(batch.old_logprobs.shape, generator=g)
    entropy = torch.rand(logprobs.shape, generator=g)

    def run(batch, logprobs, entropy):
        leaf = logprobs.clone().requires_grad_(True)
        loss, metrics = actor_loss(leaf, batch, params, policy_loss=POLICY_LOSSES[loss_name], correction=TIS, entropy=entropy)
        loss.backward()
        return loss, metrics, leaf.grad

    garbage = torch.where(torch.rand(logprobs.shape, generator=g) < 0.5, float("nan"), 1e4)
    dirty = replace(batch, **{
        name: torch.where(off, garbage, getattr(batch, name))
        for name in ("old_logprobs", "ref_logprobs", "rollout_logprobs", "advantages")
    })
    loss, metrics, grad = run(batch, logprobs, entropy)
    dirty_loss, dirty_metrics, dirty_grad = run(dirty, torch.where(off, garbage, logprobs), torch.where(off, -garbage, entropy))
    assert torch.equal(loss, dirty_loss) and metrics == dirty_metrics
    assert torch.equal(grad, dirty_grad) and (grad[off] == 0).all()


def test_extreme_log_ratios_give_a_finite_loss_and_gradient():
    g = torch.Generator().manual_seed(5)
    params = AlgorithmParams(**ALL_TERMS)
    batch = step(random_batch(g), params)
    signs = torch.where(torch.rand(batch.old_logprobs.shape, generator=g) < 0.5, -1.0, 1.0)
    extreme = replace(batch, old_logprobs=1e4 * signs, ref_logprobs=-1e4 * signs, rollout_logprobs=1e4 * signs.flip(0))
    for name, loss_fn in POLICY_LOSSES.items():
        leaf = (-1e4 * signs).requires_grad_(True)
        loss, metrics = actor_loss(leaf, extreme, params, policy_loss=loss_fn, correction=TIS, entropy=torch.ones_like(leaf))
        loss.backward()
        assert math.isfinite(loss.item()) and torch.isfinite(leaf.grad).all(), name
        assert all(math.isfinite(v) for v in metrics.values()), name


def test_critic_loss_by_hand(make_batch):
    params = AlgorithmParams(value_loss_coef=0.5, value_clip=0.2)
    batch = prepare_batch(make_batch([[1, 1, 1, 0]], values=[[1.0] * 4], returns=[[2.0, 2.0, 2.0, 0.0]]))
    values = torch.tensor([[1.5, 1.1, 0.5, 1e4]], requires_grad=True)
    loss, metrics = critic_loss(values, batch, params)
    # per token 0.64, 0.81, 2.25 (see test_losses): mean 3.7 / 3 = 1.2333333; times 0.5
    assert loss.item() == pytest.approx(0.5 * 3.7 / 3)
    assert metrics["value_loss"] == pytest.approx(3.7 / 3) and metrics["value_clipfrac"] == pytest.approx(1 / 3)
    loss.backward()
    # token 0 clipped (gradient 0); token 1: 0.5 * 2 * (1.1 - 2) / 3 = -0.3; token 2: 0.5 * 2 * (0.5 - 2) / 3 = -0.5
    assert torch.allclose(values.grad, torch.tensor([[0.0, -0.3, -0.5, 0.0]]))


def test_critic_loss_sums_over_micro_batches():
    g = torch.Generator().manual_seed(11)
    params = AlgorithmParams(loss_reduction="sequence_mean", gamma=0.95, lam=0.9)
    batch = step(random_batch(g), params, PPO())
    values = (batch.values + 0.3 * torch.randn(batch.values.shape, generator=g)).requires_grad_(True)
    full, _ = critic_loss(values, batch, params)
    parts = sum(critic_loss(values[rows][:, : batch.select(rows).tokens.shape[-1]], batch.select(rows), params)[0]
                for rows in ([0, 4], [1, 2, 3], [5]))
    assert torch.allclose(parts, full, atol=1e-6)


def test_on_policy_distillation_adds_teacher_minus_student(make_batch):
    # equal rewards: GRPO advantage 0, so A = 0.5 * (teacher - student); student = rollout (no old pass)
    batch = make_batch(
        [[0, 1, 1]], rewards=[1.0], rollout_logprobs=[[0.0, -1.0, -2.0]], teacher_logprobs=[[9.0, -0.5, -3.0]]
    )
    out = compute_advantages(batch, AlgorithmParams(opd_coef=0.5), GRPO())
    assert out.advantages.tolist() == [[0.0, 0.25, -0.5]]
    with pytest.raises(ValueError, match="opd_coef > 0 needs teacher log-probs"):
        compute_advantages(replace(batch, teacher_logprobs=None), AlgorithmParams(opd_coef=0.5), GRPO())


def test_normalize_advantages_whitens_over_tokens(make_batch):
    batch = make_batch([[1, 1, 0], [1, 0, 0], [1, 1, 1]], rewards=[3.0, 1.0, 0.0])
    out = compute_advantages(batch, AlgorithmParams(normalize_advantages=True), GRPO())
    a = out.advantages[batch.loss_mask > 0].double()
    assert abs(float(a.mean())) < 1e-6 and float(a.std(unbiased=False)) == pytest.approx(1.0, abs=1e-6)
    assert advantage_metrics(out)["advantage_std"] == pytest.approx(1.0, abs=1e-6)


def test_advantages_are_forced_to_zero_off_mask(make_batch):
    class Leaky:
        def __call__(self, batch, params):
            from miles_contracts import AdvantageResult

            return AdvantageResult(torch.ones(batch.loss_mask.shape))

    out = compute_advantages(make_batch([[0, 1]], rewards=[1.0]), AlgorithmParams(), Leaky())
    assert out.advantages.tolist() == [[0.0, 1.0]]


def test_clear_errors_for_missing_pieces(make_batch):
    params = AlgorithmParams()
    raw = two_rollouts(make_batch)
    with pytest.raises(ValueError, match="call miles_algorithms.objective.prepare_batch"):
        actor_loss(torch.zeros(2, 4), compute_advantages(raw, params, GRPO()), params, policy_loss=PPO_CLIP, correction=NONE)
    with pytest.raises(ValueError, match="call compute_advantages on the full batch first"):
        actor_loss(torch.zeros(2, 4), prepare_batch(raw), params, policy_loss=PPO_CLIP, correction=NONE)
    ready = step(raw, params)
    with pytest.raises(ValueError, match=r"logprobs has shape \(2, 3\) but the batch's loss mask is \(2, 4\)"):
        actor_loss(torch.zeros(2, 3), ready, params, policy_loss=PPO_CLIP, correction=NONE)
    with pytest.raises(ValueError, match="kl_loss_coef > 0 needs batch.ref_logprobs"):
        actor_loss(torch.zeros(2, 4), ready, AlgorithmParams(kl_loss_coef=0.1), policy_loss=PPO_CLIP, correction=NONE)
    with pytest.raises(ValueError, match="entropy_coef != 0 needs the per-token entropy"):
        actor_loss(torch.zeros(2, 4), ready, AlgorithmParams(entropy_coef=0.1), policy_loss=PPO_CLIP, correction=NONE)
    with pytest.raises(ValueError, match="ppo needs critic values"):
        compute_advantages(raw, params, ADVANTAGE_SPECS["ppo"])  # the spec declares needs_critic
    with pytest.raises(ValueError, match="the ppo estimator needs critic values"):
        compute_advantages(raw, params, PPO())  # a bare estimator: its own check
    with pytest.raises(ValueError, match="critic_loss needs batch.values"):
        critic_loss(torch.zeros(2, 4), ready, params)


def test_kl_divergence_is_exported_from_the_objective():
    assert kl_divergence(torch.tensor([0.5]), torch.tensor([0.0]), "k2").item() == pytest.approx(0.125)


# ----------------------------------------------------------------------------- packed layout


def pack(batch: TrainBatch) -> TrainBatch:
    """Concatenate each row's real tokens into one row [1, N], with cu_seqlens."""
    lengths = batch.attention_mask.sum(-1)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])

    def flat(x):
        return None if x is None else torch.cat([x[b, : lengths[b]] for b in range(batch.size)])[None, :]

    per_token = {name: flat(getattr(batch, name)) for name in (
        "tokens", "attention_mask", "loss_mask", "rollout_logprobs", "old_logprobs", "ref_logprobs",
        "teacher_logprobs", "values", "advantages", "returns")}
    return replace(batch, **per_token, extras={"cu_seqlens": cu})


def test_packed_batches_give_the_same_results_as_padded_ones():
    g = torch.Generator().manual_seed(13)
    params = AlgorithmParams(loss_reduction="sequence_mean", **ALL_TERMS)
    padded = random_batch(g)
    lengths = padded.attention_mask.sum(-1)
    packed = pack(padded)

    def flat(x):
        return torch.cat([x[b, : lengths[b]] for b in range(padded.size)])[None, :]

    padded_step = prepare_batch(compute_advantages(padded, params, PPO()))
    packed_step = prepare_batch(compute_advantages(packed, params, PPO()))
    assert torch.allclose(packed_step.advantages, flat(padded_step.advantages), atol=1e-6)
    assert torch.allclose(packed_step.returns, flat(padded_step.returns), atol=1e-6)
    assert torch.equal(packed_step.extras["cu_seqlens"], packed.extras["cu_seqlens"])

    logprobs = padded.old_logprobs + 0.2 * torch.randn(padded.old_logprobs.shape, generator=g)
    entropy = torch.rand(logprobs.shape, generator=g)
    kwargs = dict(policy_loss=PPO_CLIP, correction=TIS)
    padded_loss, padded_metrics = actor_loss(logprobs, padded_step, params, entropy=entropy, **kwargs)
    packed_loss, packed_metrics = actor_loss(flat(logprobs), packed_step, params, entropy=flat(entropy), **kwargs)
    assert torch.allclose(packed_loss, padded_loss, atol=1e-6)
    assert packed_metrics == pytest.approx(padded_metrics, abs=1e-6)
    assert critic_loss(flat(logprobs), packed_step, params)[0].item() == pytest.approx(
        critic_loss(logprobs, padded_step, params)[0].item(), abs=1e-6)
    assert mismatch_metrics(flat(logprobs), packed_step) == pytest.approx(mismatch_metrics(logprobs, padded_step))


def test_malformed_packed_batch_is_rejected(make_batch):
    batch = replace(make_batch([[1, 1, 1, 1]], rewards=[1.0]), extras={"cu_seqlens": torch.tensor([0, 2, 4])})
    with pytest.raises(ValueError, match="rewards has 1 entries but cu_seqlens describes 2 sequences"):
        prepare_batch(batch)
    batch = replace(batch, extras={"cu_seqlens": torch.tensor([0, 3, 9])})
    with pytest.raises(ValueError, match="must start at 0, increase strictly and end at most at N=4"):
        prepare_batch(batch)


def test_mini_batches_keep_rollouts_whole_and_average_the_update_metrics():
    batch = random_batch(torch.Generator().manual_seed(3))  # rollout 1 fills rows 1 and 2
    seen: list[TrainBatch] = []

    def update(mini: TrainBatch, keep: bool) -> tuple[dict[str, float], torch.Tensor | None]:
        assert not keep  # the batch has old log-probs: no forward pass is asked to keep its own
        seen.append(mini)
        return {"rows": float(mini.size), "first": float(len(seen) == 1)}, None

    def no_forward(_: TrainBatch) -> torch.Tensor:
        raise AssertionError("old log-probs are in the batch: no extra forward pass")

    totals = train_in_mini_batches(batch, 3, update, no_forward)
    assert len(seen) == 3
    assert sorted(int(i) for mini in seen for i in mini.rollout_ids.tolist()) == sorted(batch.rollout_ids.tolist())
    assert any(mini.rollout_ids.tolist() == [1, 1] for mini in seen)  # the split rollout stays together
    assert totals["rows"] == pytest.approx(6 / 3) and totals["first"] == pytest.approx(1 / 3)
    # the mismatch metrics compare the batch's own old and rollout log-probs
    assert totals["train_rollout_kl"] == pytest.approx(mismatch_metrics(batch.old_logprobs, batch)["train_rollout_kl"])


def test_mini_batches_get_old_logprobs_first_or_keep_the_single_update_forward():
    batch = replace(random_batch(torch.Generator().manual_seed(4)), old_logprobs=None)
    forwards: list[int] = []
    kept_flags: list[bool] = []

    def logprobs(whole: TrainBatch) -> torch.Tensor:
        forwards.append(whole.size)
        return whole.rollout_logprobs + 0.5

    def update(mini: TrainBatch, keep: bool) -> tuple[dict[str, float], torch.Tensor | None]:
        assert mini.old_logprobs is not None or keep
        kept_flags.append(keep)
        return {}, (mini.rollout_logprobs + 0.25) if keep else None

    # two updates: one forward over the whole batch gives the proximal policy before the first
    two = train_in_mini_batches(batch, 2, update, logprobs)
    assert forwards == [6] and kept_flags == [False, False]
    assert two == mismatch_metrics(batch.rollout_logprobs + 0.5, batch)
    # one update: no extra pass; the update's own forward pass is kept for the mismatch metrics
    forwards.clear()
    kept_flags.clear()
    one = train_in_mini_batches(batch, 1, update, logprobs)
    assert forwards == [] and kept_flags == [True]
    assert one == pytest.approx(mismatch_metrics(batch.rollout_logprobs + 0.25, batch))


def test_more_updates_than_rollouts_is_a_clear_error():
    batch = random_batch(torch.Generator().manual_seed(5))  # 5 rollouts in 6 rows
    with pytest.raises(ValueError, match=r"updates_per_step \(6\) exceeds the rollouts in the batch \(5\)"):
        train_in_mini_batches(batch, 6, lambda mini, keep: ({}, None), lambda whole: whole.rollout_logprobs)
