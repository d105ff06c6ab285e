"""Conformance suite for advantage estimators: ``check_advantage(spec)``.

The suite takes what a plugin registers, an :class:`~miles_contracts.AdvantageSpec`: its
``estimator`` (:class:`miles_contracts.AdvantageEstimator`) is called on small synthetic batches
that look like real ones: prompt groups, a rollout split into two rows, masked tool spans inside
responses, right padding, a fully masked row, a single-rollout group; the batches carry critic
values when the spec says ``needs_critic``. The suite checks, and raises ``AssertionError`` naming
the first broken rule:

- result type, ``[B, T]`` floating advantages (and returns when given), float metrics;
- every value finite, also for rewards of +-1e6, log ratios of +-1e4 and values of +-1e4;
- advantages and returns exactly 0 wherever ``loss_mask`` is 0;
- masked positions are not inputs: changing any per-token input (log-probs, values, tokens) at
  masked positions leaves advantages and returns bit-identical;
- inputs are not modified; two calls give bit-identical results;
- permuting the rows permutes the results;
- a one-row batch works;
- whitening and on-policy distillation are left to the kernel: the results are bit-identical
  whether ``normalize_advantages`` and ``opd_coef`` are on or off. The kernel's advantage stage
  (``miles.advantages.estimate_advantages``) applies both after *every* registered estimator, so
  an estimator that applied them itself would get them twice;
- ``spec.zero_sum_groups``: with no KL penalty, the advantages of a prompt group's rollouts (each
  rollout counted once, however many rows it has) sum to zero.

Each rule runs for ``params`` and for a variant with a KL penalty (``kl_coef=0.1``, k3) and
discounting (``gamma=0.9``, ``lam=0.95``).

Given the kernel's stage (``stage=miles.advantages.estimate_advantages``; this package does not
import the kernel), the suite also checks what the estimator ends with in a run: with
``normalize_advantages`` and ``opd_coef`` on, the stage's advantages are the estimator's own,
whitened over trainable tokens, plus ``opd_coef * (teacher - student)`` log-probs, and its returns
are the estimator's. torch is imported when the suite runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any

from miles_contracts.algorithm import AlgorithmParams
from miles_contracts.batch import AdvantageResult, TrainBatch
from miles_contracts.protocols import AdvantageEstimator
from miles_contracts.specs import AdvantageSpec

if TYPE_CHECKING:
    import torch

_PER_TOKEN_FLOATS = ("rollout_logprobs", "old_logprobs", "ref_logprobs", "teacher_logprobs", "values")
_KERNEL_TERMS = {"normalize_advantages": True, "opd_coef": 0.5}

AdvantageStage = Callable[[TrainBatch, AlgorithmParams, AdvantageSpec], AdvantageResult]
"""``(batch, params, spec) -> AdvantageResult``: the kernel's advantage stage."""


def check_advantage(
    spec: AdvantageSpec,
    params: AlgorithmParams | None = None,
    *,
    stage: AdvantageStage | None = None,
    seed: int = 0,
) -> None:
    """Run every rule on ``spec``; raise ``AssertionError`` on the first one broken.

    :param spec: what the plugin registers (``AdvantageSpec(estimator, needs_critic=...,
        zero_sum_groups=...)``); ``needs_critic`` and ``zero_sum_groups`` are read from it.
    :param params: base hyper-parameters (default ``AlgorithmParams()``).
    :param stage: the kernel's advantage stage (``miles.advantages.estimate_advantages``): also
        check that whitening and distillation reach the estimator's output in a run.
    :param seed: seed of the synthetic batches.
    """
    import torch

    _require(isinstance(spec, AdvantageSpec),
             f"check_advantage takes the AdvantageSpec a plugin registers (AdvantageSpec(estimator, ...)), "
             f"got {type(spec).__name__} {spec!r}")
    estimator = spec.estimator
    name = getattr(estimator, "__name__", type(estimator).__name__)
    for flag in ("needs_critic", "zero_sum_groups"):
        value = getattr(spec, flag)
        _require(isinstance(value, bool), f"{name}: AdvantageSpec.{flag} must be a bool, got {value!r}")
    base = params or AlgorithmParams()
    variants = {
        "params": base,
        "params with KL penalty and discount": base.model_copy(
            update={"kl_coef": 0.1, "kl_estimator": "k3", "gamma": 0.9, "lam": 0.95}
        ),
    }
    generator = torch.Generator().manual_seed(seed)
    batch = _synthetic_batch(generator, critic=spec.needs_critic, fully_masked_row=True)
    for label, p in variants.items():
        where = f"{name} ({label})"
        result = _run(estimator, batch, p, where)
        _check_deterministic(estimator, batch, p, result, where)
        _check_masked_inputs_ignored(estimator, batch, p, result, generator, where)
        _check_row_permutation(estimator, batch, p, result, generator, where)
        _check_extreme_inputs(estimator, batch, p, where)
        _check_kernel_terms_left_alone(estimator, batch, p, result, where)
        _run(estimator, batch.select([0]), p, f"{where}, one-row batch")
        if stage is not None:
            _check_stage_applies_kernel_terms(stage, spec, batch, p, result, f"{where}, through the kernel's stage")
    if spec.zero_sum_groups:
        zero_kl = base.model_copy(update={"kl_coef": 0.0})
        plain = _synthetic_batch(generator, critic=spec.needs_critic, fully_masked_row=False)
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


def _run(estimator: AdvantageEstimator, batch: TrainBatch, params: AlgorithmParams, where: str) -> AdvantageResult:
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
    estimator: AdvantageEstimator, batch: TrainBatch, params: AlgorithmParams, expected: AdvantageResult, generator: torch.Generator, where: str
) -> None:
    import torch

    off_mask = batch.loss_mask == 0
    # Any: replace() checks a ** mapping against every field, extras (a dict) among them
    changed: dict[str, Any] = {}
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


def _check_deterministic(estimator: AdvantageEstimator, batch: TrainBatch, params: AlgorithmParams, expected: AdvantageResult, where: str) -> None:
    again = _run(estimator, batch, params, where)
    for label in ("advantages", "returns"):
        _require(_same(getattr(again, label), getattr(expected, label)), f"{where}: two calls on the same batch gave different {label}")


def _check_row_permutation(
    estimator: AdvantageEstimator, batch: TrainBatch, params: AlgorithmParams, expected: AdvantageResult, generator: torch.Generator, where: str
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


def _check_extreme_inputs(estimator: AdvantageEstimator, batch: TrainBatch, params: AlgorithmParams, where: str) -> None:
    import torch

    on_mask = batch.loss_mask > 0
    sign = torch.where(torch.arange(batch.tokens.shape[-1]) % 2 == 0, 1.0, -1.0)
    old, ref = batch.old_logprobs, batch.ref_logprobs
    assert old is not None and ref is not None, "the synthetic batch carries old and ref log-probs"
    extreme = replace(
        batch,
        rewards=torch.where(batch.rollout_ids % 2 == 0, 1e6, -1e6),
        old_logprobs=torch.where(on_mask, -1e4 * (sign > 0), old),  # log ratio vs ref: -1e4
        ref_logprobs=torch.where(on_mask, -1e4 * (sign < 0), ref),  # and +1e4
        values=None if batch.values is None else 1e4 * sign.expand_as(batch.values),
    )
    _run(estimator, extreme, params, f"{where}, extreme inputs (rewards +-1e6, log ratios +-1e4)")


def _check_kernel_terms_left_alone(
    estimator: AdvantageEstimator, batch: TrainBatch, params: AlgorithmParams, expected: AdvantageResult, where: str
) -> None:
    """The results do not move when the kernel's own terms (whitening, distillation) are switched
    on: the estimator leaves them to the kernel, which applies them after every estimator."""
    off = params.model_copy(update={"normalize_advantages": False, "opd_coef": 0.0})
    on = params.model_copy(update=_KERNEL_TERMS)
    plain = expected if params == off else _run(estimator, batch, off, f"{where}, kernel terms off")
    result = _run(estimator, batch, on, f"{where}, normalize_advantages and opd_coef on")
    for label in ("advantages", "returns"):
        _require(_same(getattr(result, label), getattr(plain, label)),
                 f"{where}: {label} changed with normalize_advantages / opd_coef; whitening and on-policy "
                 f"distillation are the kernel's (miles.advantages), applied after every estimator: an "
                 f"estimator must not apply them itself")


def _check_stage_applies_kernel_terms(
    stage: AdvantageStage, spec: AdvantageSpec, batch: TrainBatch, params: AlgorithmParams, own: AdvantageResult,
    where: str,
) -> None:
    """The stage's advantages are the estimator's own, whitened over trainable tokens, plus the
    distillation term; its returns are the estimator's (computed here in float64, independently)."""
    import torch

    on = params.model_copy(update=_KERNEL_TERMS)
    result = stage(batch, on, spec)
    _require(isinstance(result, AdvantageResult), f"{where}: must return an AdvantageResult, got {type(result).__name__}")
    mask = batch.loss_mask > 0
    raw = torch.where(mask, own.advantages.double(), 0.0)
    count = mask.sum().clamp(min=1)
    mean = raw.sum() / count
    std = (torch.where(mask, raw - mean, 0.0).square().sum() / count).sqrt()
    student = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
    assert batch.teacher_logprobs is not None, "the synthetic batch carries teacher log-probs"
    distilled = on.opd_coef * (batch.teacher_logprobs.double() - student.double())
    want = torch.where(mask, (raw - mean) / (std + 1e-8) + distilled, 0.0)
    got = result.advantages
    _require(tuple(got.shape) == tuple(want.shape), f"{where}: advantages have shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    _require(bool((got[~mask] == 0).all()), f"{where}: advantages must be 0 where loss_mask is 0")
    diff = float((got.double() - want).abs().max())
    _require(diff <= 1e-4 * (1.0 + float(want.abs().max())),
             f"{where}: advantages are not the estimator's own whitened plus opd_coef * (teacher - student) "
             f"(off by {diff:.3g}); the kernel must apply normalize_advantages and opd_coef to every estimator")
    if own.returns is None:
        _require(result.returns is None, f"{where}: returns appeared though the estimator gives none")
    else:
        want_returns = torch.where(mask, own.returns.double(), 0.0)
        _require(result.returns is not None and torch.allclose(result.returns.double(), want_returns, atol=1e-6),
                 f"{where}: returns are not the estimator's (the kernel's terms apply to advantages only)")


def _check_zero_sum(estimator: AdvantageEstimator, batch: TrainBatch, params: AlgorithmParams, where: str) -> None:
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
