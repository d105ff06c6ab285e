"""The ``f1`` reward: token-level F1 between the response's answer and ``sample.label``.

The answer is the marked one (``\\boxed{}``, ``answer:`` ..., see :mod:`miles.rewards.answers`)
or, when nothing is marked, the whole response. Both sides are normalised the SQuAD way:
lower case, punctuation and the articles a/an/the removed, split on whitespace. When either side
has no tokens the score is 1.0 if both are empty, else 0.0. No label: NaN.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Sequence

from miles_contracts import Sample

from miles.rewards.answers import marked_answer

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def f1_tokens(text: str) -> list[str]:
    return _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split()


def token_f1(predicted: str, reference: str) -> float:
    """Harmonic mean of token precision and recall (multiset overlap)."""
    predicted_tokens, reference_tokens = f1_tokens(predicted), f1_tokens(reference)
    if not predicted_tokens or not reference_tokens:
        return float(predicted_tokens == reference_tokens)
    overlap = sum((Counter(predicted_tokens) & Counter(reference_tokens)).values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(predicted_tokens)
    recall = overlap / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def f1(samples: Sequence[Sample]) -> list[float]:
    """One token-F1 score in [0, 1] per sample; NaN for a sample without a label."""
    scores = []
    for sample in samples:
        if sample.label is None:
            scores.append(math.nan)
            continue
        answer = marked_answer(sample.response)
        scores.append(token_f1(sample.response if answer is None else answer, sample.label))
    return scores
