"""AdamW and the learning-rate schedule (:mod:`miles_algorithms.schedule`, shared by the backends)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from miles_algorithms.schedule import SCHEDULES, LRMultiplier

__all__ = ["SCHEDULES", "LRMultiplier", "build_optimizer", "build_scheduler"]

def build_optimizer(
    params: Iterable[torch.nn.Parameter],
    *,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    fused: bool,
) -> torch.optim.AdamW:
    params = [p for p in params if p.requires_grad]
    kwargs = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, **kwargs)


def build_scheduler(optimizer: torch.optim.Optimizer, multiplier: LRMultiplier) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
