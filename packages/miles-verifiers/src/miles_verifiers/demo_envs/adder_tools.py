"""verifiers environment ``miles_verifiers.demo_envs.adder_tools``: the model may call ``add`` (a
``vf.ToolEnv`` tool: verifiers runs it and appends its result) before it answers; the rubric
checks the final answer."""

from __future__ import annotations

from typing import Any

from miles_verifiers.demo_envs import answer_matches, sum_rows


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first number.
        b: the second number.
    """
    return int(a) + int(b)


def load_environment(count: int = 16, seed: int = 1, max_turns: int = 3, **kwargs: Any) -> Any:
    import verifiers as vf
    from datasets import Dataset

    async def correct_sum(completion: Any, answer: str) -> float:
        return answer_matches(completion, answer)

    return vf.ToolEnv(
        dataset=Dataset.from_list(sum_rows(count, seed)),
        system_prompt="Use the add tool, then state the sum.",
        tools=[add],
        max_turns=max_turns,
        rubric=vf.Rubric(funcs=[correct_sum]),
        **kwargs,
    )
