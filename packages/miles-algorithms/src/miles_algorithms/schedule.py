"""The learning-rate schedule of ``train.lr_schedule`` / ``train.warmup_steps``, shared by the train
backends: linear warmup, then constant / linear / cosine decay to zero.

Steps count optimiser steps (``updates_per_step`` per RL step), so the schedule's length is
``run.steps * train.updates_per_step``. The schedule is a small object rather than a lambda so that
its settings are part of a scheduler's ``state_dict`` and checkpoints restore it exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

SCHEDULES: dict[str, Callable[[float], float]] = {
    # progress in [0, 1] after warmup -> multiplier of the peak learning rate
    "constant": lambda progress: 1.0,
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
}


@dataclass
class LRMultiplier:
    """``lr(step) / peak_lr``: linear warmup over ``warmup_steps``, then ``kind`` over the rest."""

    kind: str
    warmup_steps: int
    total_steps: int

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"unknown lr schedule {self.kind!r}; choose one of {', '.join(SCHEDULES)}")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return SCHEDULES[self.kind](progress)
