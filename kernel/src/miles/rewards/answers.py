"""Finding the final answer in a model's response, and comparing answers.

The rules (also in ``docs/design/rewards.md``), first match wins:

1. the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces allowed;
2. the rest of the line after the last answer marker: ``####`` (GSM8K), ``answer:``,
   ``answer is``, ``final answer:`` (any case, markdown emphasis ignored);
3. nothing marked: the last number in the response when the reference is a number, else the last
   non-empty line.

When the reference is a number and a marked answer is not one (``answer is 12 because ...``), the
first number inside the marked answer is used. Numbers compare by value (``1,000`` == ``1000.0``,
``0.5`` == ``1/2``); everything else compares after :func:`normalize_text`.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_MARKER = re.compile(r"####|\b(?:final\s+)?answer\s*(?:is\b\s*:?|:)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+\s*/\s*\d+(?![\d.,])|-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_EMPHASIS = str.maketrans("", "", "*`")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (braces balanced), or None."""
    matches = list(_BOXED.finditer(text))
    for match in reversed(matches):
        depth, start = 1, match.end()
        for pos in range(start, len(text)):
            if text[pos] == "{":
                depth += 1
            elif text[pos] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:pos].strip()
    return None


def after_last_marker(text: str) -> str | None:
    """The first non-empty line after the last answer marker, or None when there is no marker."""
    plain = text.translate(_EMPHASIS)
    matches = list(_MARKER.finditer(plain))
    if not matches:
        return None
    rest = plain[matches[-1].end() :].strip()
    return rest.splitlines()[0].strip() if rest else ""


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def first_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[0] if found else None


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def marked_answer(response: str) -> str | None:
    """The explicitly marked answer (rules 1 and 2), or None when the response marks none."""
    boxed = last_boxed(response)
    return boxed if boxed is not None else after_last_marker(response)


def extract_answer(response: str, reference: str | None = None) -> str:
    """The final answer of ``response`` by the rules of this module (``""`` when there is none).

    :param reference: the expected answer; only whether it is a number matters (rule 3).
    """
    numeric = reference is not None and parse_number(reference) is not None
    marked = marked_answer(response)
    if marked is not None:
        if numeric and parse_number(marked) is None:
            return first_number(marked) or marked
        return marked
    if numeric:
        return last_number(response) or ""
    return last_line(response)


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact number (``-1,234.50``, ``3/4``, ``$12$``, ``12.``), or None."""
    cleaned = _TEXT_WRAPPER.sub(r"\1", text).strip().strip("$").strip().rstrip(".").replace(",", "")
    cleaned = re.sub(r"\s*/\s*", "/", cleaned)
    frac = re.fullmatch(r"\\d?frac\{(-?\d+)\}\{(\d+)\}", cleaned)
    if frac:
        cleaned = f"{frac.group(1)}/{frac.group(2)}"
    if not re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?", cleaned):
        return None
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def normalize_text(text: str) -> str:
    """Case, surrounding ``$``/quotes/emphasis, ``\\text{}`` wrappers, spacing and a final period
    do not matter."""
    text = _TEXT_WRAPPER.sub(r"\1", text).translate(_EMPHASIS)
    text = text.strip().strip("$").strip().strip("\"'").strip()
    text = text.rstrip(".。").strip()
    return " ".join(text.lower().split())


def answers_match(predicted: str, reference: str) -> bool:
    """Whether two final answers are the same: by value when both are numbers, else as text."""
    predicted_number, reference_number = parse_number(predicted), parse_number(reference)
    if predicted_number is not None and reference_number is not None:
        return predicted_number == reference_number
    return normalize_text(predicted) == normalize_text(reference)
