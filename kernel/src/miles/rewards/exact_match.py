"""The ``exact_match`` reward: 1.0 when the response's final answer equals ``sample.label``.

Extraction and comparison rules are those of :mod:`miles.rewards.answers`. A sample without a
label cannot be scored (NaN).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from miles_contracts import Sample

from miles.rewards.answers import answers_match, extract_answer


def exact_match_score(response: str, label: str) -> float:
    return 1.0 if answers_match(extract_answer(response, label), label) else 0.0


def exact_match(samples: Sequence[Sample]) -> list[float]:
    """One score per sample: 1.0 (same answer), 0.0 (different or none), NaN (no label)."""
    return [math.nan if s.label is None else exact_match_score(s.response, s.label) for s in samples]
