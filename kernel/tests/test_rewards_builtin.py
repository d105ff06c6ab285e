"""The built-in rewards exact_match and f1: answer extraction, hand-computed scores, conformance."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from miles.kernel import Kernel
from miles.plugins import PluginSelection, load_plugins
from miles.rewards.answers import answers_match, extract_answer, parse_number
from miles.rewards.exact_match import exact_match
from miles.rewards.f1 import f1, token_f1
from miles_contracts import Sample, Status
from miles_contracts.testing.reward import check_reward


def sample(response: str, label: str | None) -> Sample:
    return Sample(prompt="q", response=response, label=label, status=Status.COMPLETED)


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("So the total is \\boxed{42}.", "42", "42"),
        ("First \\boxed{1}, then \\boxed{\\frac{1}{2}}", "x", "\\frac{1}{2}"),  # last box, nested braces
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", "72"),
        ("**Answer:** 1,234", "1234", "1,234"),
        ("The answer is 12 because 6 + 6 = 12, not 13", "12", "12"),  # marked answer wins over last number
        ("6 + 6 = 12", "12", "12"),  # no marker: last number
        ("It is -3.5 degrees", "-3.5", "-3.5"),
        ("Thinking...\nParis", "Paris", "Paris"),  # text label: last line
        ("Final answer: Rome\n", "Rome", "Rome"),
        ("no digits here", "7", ""),
    ],
)
def test_extract_answer(response: str, label: str, expected: str) -> None:
    assert extract_answer(response, label) == expected


@pytest.mark.parametrize(
    ("text", "value"),
    [("42", Fraction(42)), ("1,000", Fraction(1000)), ("3.50", Fraction(7, 2)), ("3/4", Fraction(3, 4)),
     ("\\frac{3}{4}", Fraction(3, 4)), ("$12$", Fraction(12)), ("12.", Fraction(12)), ("-0.5", Fraction(-1, 2)),
     ("twelve", None), ("1/0", None), ("", None)],
)
def test_parse_number(text: str, value: Fraction | None) -> None:
    assert parse_number(text) == value


def test_answers_match_numbers_by_value_and_text_normalised() -> None:
    assert answers_match("1000.0", "1,000")
    assert answers_match("0.5", "1/2")
    assert not answers_match("0.51", "1/2")
    assert answers_match(" The Eiffel  Tower. ", "the eiffel tower")
    assert answers_match("\\text{Paris}", "paris")
    assert not answers_match("Paris", "Rome")


def test_exact_match_scores() -> None:
    batch = [
        sample("The answer is 72.", "72"),
        sample("I get \\boxed{71}", "72"),
        sample("", "72"),
        sample("72", None),
        sample("7 + 5 = 12", "12"),
    ]
    scores = exact_match(batch)
    assert scores[:3] == [1.0, 0.0, 0.0]
    assert math.isnan(scores[3])
    assert scores[4] == 1.0


def test_token_f1_hand_computed() -> None:
    # normalised: [cat, sat, on, mat] both -> 1.0 (articles and punctuation removed)
    assert token_f1("The cat sat on the mat.", "a cat sat on mat") == 1.0
    # common 2; precision 2/2, recall 2/4 -> 2 * 1 * 0.5 / 1.5 = 2/3
    assert token_f1("cat sat", "cat sat on mat") == pytest.approx(2 / 3)
    # pred [red, red, blue], gold [red, blue, green]: overlap red1 + blue1 = 2; P = R = 2/3 -> 2/3
    assert token_f1("red red blue", "red blue green") == pytest.approx(2 / 3)
    assert token_f1("dog", "cat") == 0.0
    assert token_f1("the", "a") == 1.0  # both empty after normalisation
    assert token_f1("", "cat") == 0.0


def test_f1_uses_the_marked_answer_else_the_whole_response() -> None:
    scores = f1([sample("Some reasoning. Answer: Barack Obama", "Obama"), sample("Barack Obama", "Barack Obama"), sample("x", None)])
    # marked "Barack Obama" vs "Obama": P 1/2, R 1 -> 2/3
    assert scores[0] == pytest.approx(2 / 3)
    assert scores[1] == 1.0
    assert math.isnan(scores[2])


@pytest.fixture(scope="module")
def kernel() -> Kernel:
    selection = PluginSelection(enable=("rewards",))
    return Kernel(load_plugins(selection), selection)


@pytest.mark.parametrize("name", ["exact_match", "f1"])
def test_registered_rewards_conform(kernel: Kernel, name: str) -> None:
    check_reward(kernel.rewards().get(name))


def test_conformance_suite_catches_a_broken_reward() -> None:
    def shifted(samples: list[Sample]) -> list[float]:  # scores depend on the batch position
        return [float(i) for i, _ in enumerate(samples)]

    with pytest.raises(AssertionError, match="differ from scores one by one"):
        check_reward(shifted)

    def raising(samples: list[Sample]) -> list[float]:
        return [1.0 / len(s.response) for s in samples]

    with pytest.raises(AssertionError, match="raised ZeroDivisionError for sample 101"):
        check_reward(raising)
