"""verifiers environment ``miles_verifiers.demo_envs.sum_single_turn``: one question, one answer,
a rubric that checks it (``vf.SingleTurnEnv``)."""

from __future__ import annotations

from typing import Any

from miles_verifiers.demo_envs import answer_matches, sum_rows


def load_environment(count: int = 16, seed: int = 0, **kwargs: Any) -> Any:
    import verifiers as vf
    from datasets import Dataset

    async def correct_sum(completion: Any, answer: str) -> float:
        return answer_matches(completion, answer)

    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(sum_rows(count, seed)),
        system_prompt="Answer with the number only.",
        rubric=vf.Rubric(funcs=[correct_sum]),
        **kwargs,
    )
