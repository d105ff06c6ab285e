"""The arithmetic task: correct answers, determinism, a held-out split that never leaks, resume."""

from __future__ import annotations

import json

import pytest
from miles.context import context_for
from miles.data import DataError, eval_prompts, open_data_source
from miles.data.arithmetic import ArithmeticTask, Problem
from miles.kernel import Kernel
from miles.plugins import PluginSelection, load_plugins
from miles.rewards.exact_match import exact_match
from miles.sections import DataSection
from miles_contracts import Sample, Status


@pytest.fixture(scope="module")
def kernel() -> Kernel:
    selection = PluginSelection(enable=("data",))
    return Kernel(load_plugins(selection), selection)


def task(kernel: Kernel, seed: int = 0, **options) -> ArithmeticTask:
    return open_data_source(context_for(kernel=kernel), DataSection(source="arithmetic", seed=seed, options=options))


def test_problems_follow_operator_precedence() -> None:
    assert Problem((3, 4, 2), ("+", "*")).expression == "3 + 4 * 2"
    assert Problem((3, 4, 2), ("+", "*")).answer == 11
    assert Problem((2, 3, 4), ("*", "-")).answer == 2
    assert Problem((9, 3), ("-",)).answer == 6
    assert Problem((1, 5, 2, 3), ("-", "*", "+")).answer == -6


def test_default_prompts_are_single_digit_additions_asking_for_a_bare_number(kernel: Kernel) -> None:
    samples = task(kernel).next_prompts(50)
    for sample in samples:
        [message] = sample.prompt
        a, op, b = sample.metadata["expression"].split()
        assert message == {"role": "user", "content": f"Compute {a} + {b}. Reply with only the final number."}
        assert op == "+" and 0 <= int(a) <= 9 and 0 <= int(b) <= 9
        assert sample.label == str(int(a) + int(b))
        assert sample.metadata["task"] == "arithmetic" and sample.metadata["split"] == "train"


def test_the_stream_is_deterministic_from_the_seed(kernel: Kernel) -> None:
    first = [s.metadata["expression"] for s in task(kernel, seed=5, digits=2).next_prompts(30)]
    again = [s.metadata["expression"] for s in task(kernel, seed=5, digits=2).next_prompts(30)]
    other = [s.metadata["expression"] for s in task(kernel, seed=6, digits=2).next_prompts(30)]
    assert first == again and first != other


@pytest.mark.parametrize("options", [{}, {"digits": 3, "operations": ["+", "-", "*"]}])
def test_held_out_problems_never_appear_in_training(kernel: Kernel, options: dict) -> None:
    source = task(kernel, **options)
    held_out = {s.metadata["expression"] for s in source.eval_prompts(200)}
    trained = {s.metadata["expression"] for s in source.next_prompts(2000)}
    assert held_out and not held_out & trained
    assert all(source.is_held_out(Problem(tuple(map(int, e.split()[::2])), tuple(e.split()[1::2]))) for e in held_out)


def test_the_eval_split_is_the_same_for_every_seed_and_call(kernel: Kernel) -> None:
    config = DataSection(source="arithmetic", seed=1)
    first = [s.metadata["expression"] for s in eval_prompts(context_for(kernel=kernel), 16, config=config)]
    assert first == [s.metadata["expression"] for s in eval_prompts(context_for(kernel=kernel), 16, config=config.model_copy(update={"seed": 9}))]
    assert len(first) == len(set(first)) == 16
    small_space = task(kernel).eval_prompts(1000)  # single-digit addition: 100 problems, about 20 held out
    assert 5 < len(small_space) < 40


def test_resume_continues_the_stream(kernel: Kernel) -> None:
    running = task(kernel, seed=2)
    running.next_prompts(13)
    state = json.loads(json.dumps(running.state_dict()))
    expected = [s.metadata["expression"] for s in running.next_prompts(10)]
    resumed = task(kernel, seed=2)
    resumed.load_state_dict(state)
    assert [s.metadata["expression"] for s in resumed.next_prompts(10)] == expected
    with pytest.raises(DataError, match="saved arithmetic position is for seed 2"):
        task(kernel, seed=3).load_state_dict(state)


def test_labels_are_what_exact_match_expects(kernel: Kernel) -> None:
    samples = task(kernel, digits=2, operations=["+", "-", "*"], operands=3).next_prompts(20)
    replies = [Sample(response=f"The answer is {s.label}.", label=s.label, status=Status.COMPLETED) for s in samples]
    assert exact_match(replies) == [1.0] * 20


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"digits": 0}, "data.options.digits: Input should be greater than or equal to 1"),
        ({"operations": ["/"]}, "data.options.operations.0: Input should be '+', '-' or '*'"),
        ({"digts": 2}, "data.options.digts: not an option of this data source"),
        ({"instruction": "What is it?"}, "data.options.instruction: String should match pattern"),
    ],
)
def test_bad_options_are_reported(kernel: Kernel, options: dict, message: str) -> None:
    with pytest.raises(DataError) as info:
        task(kernel, **options)
    assert message in str(info.value)
