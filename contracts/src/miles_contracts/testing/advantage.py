"""Conformance suite for advantage estimators: ``check_advantage(estimator)``.

An estimator (:class:`miles_contracts.AdvantageEstimator`) is called on small synthetic batches
that look like real ones: prompt groups, a rollout split into two rows, masked tool spans inside
responses, right padding, a fully masked row, a single-rollout group. The suite checks, and raises
``AssertionError`` naming the first broken rule:

- result type, ``[B, T]`` floating advantages (and returns when given), float metrics;
- every value finite, also for rewards of +-1e6, log ratios of +-1e4 and values of +-1e4;
- advantages and returns exactly 0 wherever ``loss_mask`` is 0;
- masked positions are not inputs: changing any per-token input (log-probs, values, tokens) at
  masked positions leaves advantages and returns bit-identical;
- inputs are not modified; two calls give bit-identical results;
- permuting the rows permutes the results;
- a one-row batch works;
- ``zero_sum_groups``: with no KL penalty, the advantages of a prompt group's rollouts (each
  rollout counted once, however many rows it has) sum to zero.

Each rule runs for ``params`` and for a variant with a KL penalty (``kl_coef=0.1``, k3) and
discounting (``gamma=0.9``, ``lam=0.95``). torch is imported when the suite runs.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any

from miles_contracts.algorithm import AlgorithmParams
from miles_contracts.batch import AdvantageResult, TrainBatch

if TYPE_CHECKING:
    import torch

_PER_TOKEN_FLOATS = ("rollout_logprobs", "old_logprobs", "ref_logprobs", "teacher_logprobs", "values")


def check_advantage(
    estimator: Any,
    params: AlgorithmParams | None = None,
    *,
    zero_sum_groups: bool | None = None,
    seed: int = 0,
) -> None:
    """Run every rule on ``estimator``; raise ``AssertionError`` on the first one broken.

    :param estimator: the callable ``(batch, params) -> AdvantageResult`` with ``needs_critic``.
    :param params: base hyper-parameters (default ``AlgorithmParams()``).
    :param zero_sum_groups: check group advantages sum to zero; default: the estimator's
        ``zero_sum_groups`` attribute (False when absent).
    :param seed: seed of the synthetic batches.
    """
    import torch

    name = getattr(estimator, "__name__", type(estimator).__name__)
    needs_critic = getattr(estimator, "needs_critic", None)
    _require(isinstance(needs_critic, bool), f"{name}: needs_critic must be a bool class attribute, got {needs_critic!r}")
    if zero_sum_groups is None:
        zero_sum_groups = bool(getattr(estimator, "zero_sum_groups", False))
    base = params or AlgorithmParams()
    variants = {
        "params": base,
        "params with KL penalty and discount": base.model_copy(
            update={"kl_coef": 0.1, "kl_estimator": "k3", "gamma": 0.9, "lam": 0.95}
        ),
    }
    generator = torch.Generator().manual_seed(seed)
    batch = _synthetic_batch(generator, critic=needs_critic, fully_masked_row=True)
    for label, p in variants.items():
        where = f"{name} ({label})"
        result = _run(estimator, batch, p, where)
        _check_deterministic(estimator, batch, p, result, where)
        _check_masked_inputs_ignored(estimator, batch, p, result, generator, where)
        _check_row_permutation(estimator, batch, p, result, generator, where)
        _check_extreme_inputs(estimator, batch, p, where)
        _run(estimator, batch.select([0]), p, f"{where}, one-row batch")
    if zero_sum_groups:
        zero_kl = base.model_copy(update={"kl_coef": 0.0})
        plain = _synthetic_batch(generator, critic=needs_critic, fully_masked_row=False)
        _check_zero_sum(estimator, plain, zero_kl, f"{name} (group zero sum)")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _synthetic_batch(generator: torch.Generator, *, critic: bool, fully_masked_row: bool) -> TrainBatch:
    """Eight rows, width 14: prompts, responses with masked tool spans, right padding.

    Groups and rollouts (rollout 1 is split over rows 1 and 2; group 2 has a single rollout)::

        row:      0  1  2  3  4  5  6  7
        group:    0  0  0  0  1  1  1  2
        rollout:  0  1  1  2  3  4  5  6
    """
    import torch

    # (prompt length, response length, masked tool span inside the response as (start, end) or None)
    shapes = [(3, 8, (3, 5)), (2, 6, None), (4, 9, (2, 4)), (3, 11, (5, 8)), (2, 5, None), (5, 9, (1, 3)), (3, 7, None), (2, 12, (6, 9))]
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2])
    rollout_ids = torch.tensor([0, 1, 1, 2, 3, 4, 5, 6])
    b, width = len(shapes), 14
    tokens = torch.randint(5, 1000, (b, width), generator=generator)
    attention = torch.zeros(b, width, dtype=torch.long)
    loss_mask = torch.zeros(b, width)
    for row, (prompt, response, tool) in enumerate(shapes):
        attention[row, : prompt + response] = 1
        loss_mask[row, prompt : prompt + response] = 1.0
        if tool is not None:
            loss_mask[row, prompt + tool[0] : prompt + tool[1]] = 0.0
    if fully_masked_row:
        loss_mask[5] = 0.0
    rollout_reward = torch.randn(int(rollout_ids.max()) + 1, generator=generator)
    rollout_logprobs = -torch.rand(b, width, generator=generator) * 3 * loss_mask  # engine: 0 off-mask
    old = rollout_logprobs + 0.05 * torch.randn(b, width, generator=generator)
    return TrainBatch(
        tokens=tokens,
        attention_mask=attention,
        loss_mask=loss_mask,
        rollout_logprobs=rollout_logprobs,
        rewards=rollout_reward[rollout_ids],
        group_ids=group_ids,
        rollout_ids=rollout_ids,
        old_logprobs=old,
        ref_logprobs=old + 0.1 * torch.randn(b, width, generator=generator),
        teacher_logprobs=old + 0.2 * torch.randn(b, width, generator=generator),
        values=torch.randn(b, width, generator=generator) if critic else None,
    )


def _clone(batch: TrainBatch) -> TrainBatch:
    return replace(batch, **{f.name: getattr(batch, f.name).clone() for f in fields(batch)
                             if f.name != "extras" and getattr(batch, f.name) is not None})


def _run(estimator: Any, batch: TrainBatch, params: AlgorithmParams, where: str) -> AdvantageResult:
    import torch

    before = _clone(batch)
    result = estimator(batch, params)
    _require(isinstance(result, AdvantageResult), f"{where}: must return an AdvantageResult, got {type(result).__name__}")
    for f in fields(batch):
        value, original = getattr(batch, f.name), getattr(before, f.name)
        if f.name != "extras" and value is not None:
            _require(torch.equal(value, original), f"{where}: modified its input batch.{f.name}; estimators must not write to the batch")
    shape = tuple(batch.loss_mask.shape)
    off_mask = batch.loss_mask == 0
    for label, tensor in (("advantages", result.advantages), ("returns", result.returns)):
        if tensor is None:
            _require(label == "returns", f"{where}: advantages is None")
            continue
        _require(isinstance(tensor, torch.Tensor), f"{where}: {label} must be a torch.Tensor, got {type(tensor).__name__}")
        _require(tuple(tensor.shape) == shape, f"{where}: {label} has shape {tuple(tensor.shape)}, expected {shape} (like loss_mask)")
        _require(tensor.is_floating_point(), f"{where}: {label} must be floating point, got {tensor.dtype}")
        broken = ~torch.isfinite(tensor)
        if broken.any():
            raise AssertionError(f"{where}: {label} has non-finite entries, first at [row, column] {_first(broken)}")
        leaked = off_mask & (tensor != 0)
        if leaked.any():
            raise AssertionError(f"{where}: {label} must be 0 where loss_mask is 0; nonzero at [row, column] {_first(leaked)}")
    _require(isinstance(result.metrics, dict), f"{where}: metrics must be a dict")
    for key, value in result.metrics.items():
        _require(isinstance(key, str) and isinstance(value, (int, float)), f"{where}: metric {key!r}={value!r} must be str -> float")
    return result


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    import torch

    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _check_masked_inputs_ignored(
    estimator: Any, batch: TrainBatch, params: AlgorithmParams, expected: AdvantageResult, generator: torch.Generator, where: str
) -> None:
    import torch

    off_mask = batch.loss_mask == 0
    changed = {}
    for name in _PER_TOKEN_FLOATS:
        value = getattr(batch, name)
        if value is not None:
            noise = torch.where(torch.rand(value.shape, generator=generator) < 0.5, -1e4, 1e4)
            changed[name] = torch.where(off_mask, noise * torch.rand(value.shape, generator=generator), value)
    changed["tokens"] = torch.where(off_mask, torch.randint(5, 1000, batch.tokens.shape, generator=generator), batch.tokens)
    result = _run(estimator, replace(batch, **changed), params, f"{where}, masked inputs changed")
    for label in ("advantages", "returns"):
        _require(_same(getattr(result, label), getattr(expected, label)),
                 f"{where}: {label} changed when only inputs at masked positions (loss_mask 0) changed")


def _check_deterministic(estimator: Any, batch: TrainBatch, params: AlgorithmParams, expected: AdvantageResult, where: str) -> None:
    again = _run(estimator, batch, params, where)
    for label in ("advantages", "returns"):
        _require(_same(getattr(again, label), getattr(expected, label)), f"{where}: two calls on the same batch gave different {label}")


def _check_row_permutation(
    estimator: Any, batch: TrainBatch, params: AlgorithmParams, expected: AdvantageResult, generator: torch.Generator, where: str
) -> None:
    import torch

    order = torch.randperm(batch.size, generator=generator)
    result = _run(estimator, batch.select(order), params, f"{where}, rows permuted")
    width = result.advantages.shape[-1]
    for label in ("advantages", "returns"):
        got, want = getattr(result, label), getattr(expected, label)
        if want is None:
            _require(got is None, f"{where}: returns appeared after permuting rows")
            continue
        _require(torch.allclose(got, want[order][:, :width], rtol=1e-5, atol=1e-5),
                 f"{where}: permuting the rows did not permute {label} (rows must be independent of their order)")


def _check_extreme_inputs(estimator: Any, batch: TrainBatch, params: AlgorithmParams, where: str) -> None:
    import torch

    on_mask = batch.loss_mask > 0
    sign = torch.where(torch.arange(batch.tokens.shape[-1]) % 2 == 0, 1.0, -1.0)
    extreme = {
        "rewards": torch.where(batch.rollout_ids % 2 == 0, 1e6, -1e6),
        "old_logprobs": torch.where(on_mask, -1e4 * (sign > 0), batch.old_logprobs),  # log ratio vs ref: -1e4
        "ref_logprobs": torch.where(on_mask, -1e4 * (sign < 0), batch.ref_logprobs),  # and +1e4
    }
    if batch.values is not None:
        extreme["values"] = 1e4 * sign.expand_as(batch.values)
    _run(estimator, replace(batch, **extreme), params, f"{where}, extreme inputs (rewards +-1e6, log ratios +-1e4)")


def _check_zero_sum(estimator: Any, batch: TrainBatch, params: AlgorithmParams, where: str) -> None:

    advantages = _run(estimator, batch, params, where).advantages
    mask = batch.loss_mask > 0
    first = mask.float().argmax(dim=-1)  # each row's first trainable token
    per_row = advantages.gather(-1, first[:, None]).squeeze(-1)
    seen: set[int] = set()
    totals: dict[int, float] = {}
    for row in range(batch.size):
        rollout = int(batch.rollout_ids[row])
        if rollout in seen or not bool(mask[row].any()):
            continue
        seen.add(rollout)
        group = int(batch.group_ids[row])
        totals[group] = totals.get(group, 0.0) + float(per_row[row])
    scale = 1.0 + float(advantages.abs().max())
    for group, total in totals.items():
        _require(abs(total) <= 1e-4 * scale,
                 f"{where}: advantages of group {group}'s rollouts (each counted once) sum to {total}, expected 0")
