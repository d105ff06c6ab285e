"""Evaluation metrics: accuracy and the unbiased pass@k estimator over scored prompt groups.

A sample is *correct* when its reward reaches ``threshold`` (1.0: the binary rewards ``exact_match``
and ``math`` give 1.0 for a right answer); a sample without a reward (failed, aborted) is wrong.
:func:`evaluation_metrics` names its metrics without a prefix (``accuracy``, ``pass@4``); the loop
logs them as ``eval/<name>`` (:func:`metric_name`; with a dataset, ``eval/<dataset>/<name>``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from miles_contracts import Sample, Status


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` answers drawn without replacement from ``n``
    answers, ``c`` of them correct, is correct: ``1 - C(n-c, k) / C(n, k)`` (Chen et al., 2021),
    computed as a product so that large ``n`` does not overflow."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: correct count c={c} must be within [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} must be within [1, n={n}] (draw at least k samples per prompt)")
    if n - c < k:
        return 1.0
    miss_all = 1.0
    for i in range(n - c + 1, n + 1):
        miss_all *= 1.0 - k / i
    return 1.0 - miss_all


def is_correct(sample: Sample, threshold: float = 1.0) -> bool:
    return sample.reward is not None and math.isfinite(sample.reward) and sample.reward >= threshold


def default_ks(n: int) -> list[int]:
    """The k reported for ``n`` samples per prompt: powers of two below ``n``, and ``n``."""
    ks = [1 << i for i in range(n.bit_length()) if (1 << i) < n]
    return [*ks, n] if n >= 1 else []


def metric_name(prefix: str, name: str, dataset: str | None = None) -> str:
    return "/".join(part for part in (prefix, dataset, name) if part)


def evaluation_metrics(
    groups: Sequence[Sequence[Sample]],
    k: int | None = None,
    *,
    ks: Sequence[int] | None = None,
    threshold: float = 1.0,
) -> dict[str, float]:
    """Metrics of scored evaluation groups (one group = the samples of one prompt).

    ``accuracy`` is the share of correct samples; ``pass@j`` is averaged over prompts for each
    ``j`` in ``ks`` (default :func:`default_ks` of ``k``, the samples drawn per prompt, or of the
    smallest group) that every group can supply. Also ``reward_mean`` (over scored samples),
    ``failed_frac``, ``truncated_frac``, ``response_length_mean`` (tokens) and ``num_prompts``.
    """
    groups = [g for g in groups if g]
    samples = [s for g in groups for s in g]
    if not samples:
        return {"num_prompts": 0.0}
    smallest = min(len(g) for g in groups)
    out = {
        "num_prompts": float(len(groups)),
        "accuracy": sum(is_correct(s, threshold) for s in samples) / len(samples),
        "failed_frac": sum(s.status in (Status.FAILED, Status.ABORTED) for s in samples) / len(samples),
        "truncated_frac": sum(s.status is Status.TRUNCATED for s in samples) / len(samples),
        "response_length_mean": sum(s.response_length for s in samples) / len(samples),
    }
    rewards = [s.reward for s in samples if s.reward is not None and math.isfinite(s.reward)]
    if rewards:
        out["reward_mean"] = sum(rewards) / len(rewards)
    for j in ks if ks is not None else default_ks(k or smallest):
        if j <= smallest:
            per_prompt = [pass_at_k(len(g), sum(is_correct(s, threshold) for s in g), j) for g in groups]
            out[f"pass@{j}"] = sum(per_prompt) / len(per_prompt)
    return out
