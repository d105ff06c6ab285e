"""Two small verifiers environments written against verifiers' public API, used by this package's
tests, ``miles bench conformance`` and the README: ``sum_single_turn`` (one answer, checked by a
rubric) and ``adder_tools`` (a ``ToolEnv``: the model calls ``add`` and then answers)."""

from __future__ import annotations

import random


def sum_rows(count: int, seed: int) -> list[dict[str, str]]:
    """``count`` addition questions with their answers, the same for the same seed."""
    rng = random.Random(f"miles-verifiers-demo:{seed}")
    rows = []
    for _ in range(count):
        a, b = rng.randrange(100), rng.randrange(100)
        rows.append({"question": f"What is {a} + {b}?", "answer": str(a + b)})
    return rows


def answer_matches(completion: object, answer: str) -> float:
    """1.0 when the last assistant message states ``answer`` as a whole number, else 0.0."""
    import re

    text = ""
    if isinstance(completion, list):
        for message in completion:
            role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
            if role == "assistant":
                content = message.get("content") if isinstance(message, dict) else getattr(message, "content", None)
                text = content if isinstance(content, str) else ""
    elif isinstance(completion, str):
        text = completion
    return 1.0 if answer in re.findall(r"-?\d+", text) else 0.0
