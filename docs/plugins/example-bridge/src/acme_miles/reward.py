"""The ``concise`` reward: 1.0 up to ``max_words`` words, then down to 0.0 at twice as many."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from miles_contracts import RewardSpec, RunContext, Sample
from pydantic import BaseModel, ConfigDict, Field


class ConciseSection(BaseModel):
    """The ``concise`` config section."""

    model_config = ConfigDict(extra="forbid")  # a misspelled key is an error, not ignored

    max_words: int = Field(default=50, ge=1, description="responses up to this many words score 1.0")


@dataclass(frozen=True)
class ConciseReward:
    max_words: int = 50

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        return [self.score(sample.response) for sample in samples]

    def score(self, response: str) -> float:
        words = len(response.split())
        return max(0.0, min(1.0, 2.0 - words / self.max_words))


def for_run(ctx: RunContext) -> ConciseReward:
    """The reward a run scores with: its ``concise`` section's ``max_words``."""
    return ConciseReward(ctx.config.section("concise", ConciseSection).max_words)


CONCISE = RewardSpec(ConciseReward(), bind=for_run)
