"""The check that runs inside a worker process: is ``response``'s answer ``label``, symbolically?

math-verify extracts the answer (last ``\\boxed{}`` first, then other LaTeX / plain expressions),
parses both sides to sympy and compares them (numeric tolerance, equivalent expressions, sets and
intervals). Its own timeouts use ``SIGALRM``, which works here because a pool worker runs tasks
on its main thread.
"""

from __future__ import annotations

import math


def warm_up() -> None:
    """Pool initializer: import sympy and math-verify once per worker, before the first task."""
    import math_verify  # noqa: F401


def parse_reference(label: str, seconds: int) -> list:
    """The reference answer parsed by math-verify (empty when it cannot be parsed).

    A bare reference (``1/2``, ``(1, 2)``, ``x^2+1``) is read as if it were boxed, which is how a
    dataset's answer column is meant; one that already has ``$`` or ``\\boxed`` is read as is.
    """
    from math_verify import parse

    text = label if ("$" in label or "\\boxed" in label) else "\\boxed{" + label + "}"
    return parse(text, parsing_timeout=seconds) or parse(label, parsing_timeout=seconds)


def check_answer(task: tuple[str, str, int]) -> float:
    """1.0 if the response's final answer equals the reference, 0.0 if not, NaN if the reference
    itself cannot be parsed. ``task`` is ``(response, label, seconds per parse/compare)``."""
    from math_verify import parse, verify

    response, label, seconds = task
    reference = parse_reference(label, seconds)
    if not reference:
        return math.nan
    predicted = parse(response, parsing_timeout=seconds)
    if not predicted:
        return 0.0
    return 1.0 if verify(reference, predicted, timeout_seconds=seconds) else 0.0
