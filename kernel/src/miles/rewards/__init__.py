"""Rewards: the built-in reward functions and :func:`score_samples`, which the RL loop calls.

A reward is a plain sync or async function ``(samples) -> list[float]`` registered by name through
``miles_register_rewards``; see ``docs/design/rewards.md``.
"""

from miles.rewards.pool import Failed, WorkerPool
from miles.rewards.scoring import (
    ScoreReport,
    reward_name_of,
    score_samples,
    score_samples_blocking,
)

__all__ = ["Failed", "ScoreReport", "WorkerPool", "reward_name_of", "score_samples", "score_samples_blocking"]
