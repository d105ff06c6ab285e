"""DAPO's soft overlong punishment (``reward.overlong``), added to a reward after it was scored.

With ``L_max`` = ``max_length``, ``L_cache`` = ``buffer`` and ``|y|`` the sample's model-written
tokens (the ones its ``loss_mask`` trains: the whole response of a single turn, the model's turns
of a multi-turn trajectory, never tool output)::

    penalty(|y|) = 0                                  if |y| <= L_max - L_cache
                 = ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max
                 = -1                                 if |y| > L_max

times ``factor`` (DAPO, Yu et al. 2025, eq. 13). The penalty falls linearly to ``-factor`` at
``L_max``, so a response cut at its length limit gets the whole penalty, and one that ends just
inside the buffer only a little of it: a gradient toward shorter answers without punishing a
good answer for being long by a few tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles_contracts import Sample

if TYPE_CHECKING:
    from miles.sections import OverlongPenalty


def overlong_penalty(length: int, config: OverlongPenalty) -> float:
    """The penalty (<= 0) for ``length`` model-written tokens."""
    start = config.max_length - config.buffer
    if length <= start:
        return 0.0
    if length > config.max_length:
        return -config.factor
    return config.factor * (start - length) / config.buffer


def model_tokens(sample: Sample) -> int:
    """``|y|``: the response tokens the model wrote (its ``loss_mask``; the whole response without one)."""
    return sum(sample.loss_mask) if sample.loss_mask else sample.response_length


def apply_overlong_penalty(sample: Sample, config: OverlongPenalty) -> float:
    """Add the penalty to a scored sample's reward (and to each of its per-role rewards); keep it in
    ``metadata["overlong_penalty"]`` when it is not 0. Returns it."""
    penalty = overlong_penalty(model_tokens(sample), config)
    if penalty and sample.reward is not None:
        sample.reward += penalty
        sample.role_rewards = {role: value + penalty for role, value in sample.role_rewards.items()}
        sample.metadata["overlong_penalty"] = penalty
    return penalty
