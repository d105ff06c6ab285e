"""The long-tail workload: how long each turn is and how long each tool call takes.

An episode is ``turns`` model turns with a tool call between consecutive ones. Each turn's token
budget is log-normal (median ``tokens_median``, shape ``tokens_sigma``, clipped to
``[2, tokens_max]``) and the random tiny model rarely stops early, so response lengths are heavy
tailed. Each tool call sleeps a Pareto-distributed time (scale ``latency_scale`` seconds, shape
``latency_alpha``: the smaller, the heavier the tail; capped at ``latency_max``): most calls are
quick, a few take many times the median, which is what agentic rollouts look like (a test suite
that hangs, a slow web page).

Draws depend only on ``(seed, sample index)``, so every loop mode of a benchmark (and a group
generated again after going stale) sees the same episode for the same sample.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from miles.sections import Section
from pydantic import Field


class LongTailSection(Section):
    """The ``longtail`` config section (read by the ``long_tail`` agent)."""

    seed: int = 0
    turns: int = Field(default=3, ge=1, description="model turns per trajectory; a tool call between consecutive ones")
    tokens_median: int = Field(default=12, ge=1, description="median token budget of a turn (log-normal)")
    tokens_sigma: float = Field(default=0.8, ge=0, description="log-normal shape of the token budget")
    tokens_max: int = Field(default=64, ge=2, description="largest token budget of a turn")
    latency_scale: float = Field(default=0.1, ge=0, description="seconds: the shortest tool call (Pareto scale)")
    latency_alpha: float = Field(default=1.3, gt=0, description="Pareto shape of the tool latency: smaller is heavier")
    latency_max: float = Field(default=30.0, ge=0, description="seconds: longest tool call")


@dataclass(frozen=True, slots=True)
class Episode:
    """``tokens[k]``: token budget of turn k; ``latencies[k]``: seconds of the tool call after turn k."""

    tokens: tuple[int, ...]
    latencies: tuple[float, ...]

    @property
    def tool_seconds(self) -> float:
        return sum(self.latencies)


def episode(settings: LongTailSection, index: int) -> Episode:
    """The episode of sample ``index`` (deterministic)."""
    rng = random.Random(f"miles-longtail:{settings.seed}:{index}")
    tokens = tuple(
        min(settings.tokens_max, max(2, round(settings.tokens_median * math.exp(settings.tokens_sigma * rng.gauss(0, 1)))))
        for _ in range(settings.turns)
    )
    latencies = tuple(
        min(settings.latency_max, settings.latency_scale / (1.0 - rng.random()) ** (1.0 / settings.latency_alpha))
        for _ in range(settings.turns - 1)
    )
    return Episode(tokens, latencies)
