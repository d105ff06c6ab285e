"""The ``verifiers`` data source: the rows of a verifiers environment's dataset as Miles prompts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from miles_contracts import RunContext, Sample

from miles_verifiers.loading import load_environment
from miles_verifiers.section import VerifiersSection

if TYPE_CHECKING:
    from miles.sections import DataSection


class VerifiersDataSource:
    """A :class:`miles_contracts.DataSource` over ``env.get_dataset()`` (``data.eval_path`` set:
    ``env.get_eval_dataset()``), in order, wrapping around at the end.

    Each sample's ``prompt`` is the row's chat messages (the environment's system prompt and
    few-shot turns included), ``label`` its ``answer`` and ``metadata["verifiers"]`` the rest of
    the row (``example_id``, ``answer``, ``task``, ``info`` where it has them), which the ``verifiers`` agent hands back to the
    environment's rollout.
    """

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            raise ValueError("the verifiers environment's dataset is empty: nothing to train on")
        self._rows = rows
        self.position = 0

    @classmethod
    def open(cls, ctx: RunContext, data: DataSection) -> VerifiersDataSource:
        env = load_environment(ctx.config.section("verifiers", VerifiersSection))
        dataset = env.get_eval_dataset() if data.eval_path else env.get_dataset()
        return cls([dict(row) for row in dataset])

    def next_prompts(self, n: int) -> list[Sample]:
        out = []
        for _ in range(n):
            out.append(_sample(self._rows[self.position % len(self._rows)]))
            self.position += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.position = int(state["position"])


def _sample(row: Mapping[str, Any]) -> Sample:
    answer = row.get("answer")
    return Sample(
        prompt=row["prompt"],
        label=None if answer is None else str(answer),
        # what the environment's rollout reads besides the prompt, as the dataset has it
        metadata={"verifiers": {key: row[key] for key in ROLLOUT_FIELDS if row.get(key) is not None}},
    )


ROLLOUT_FIELDS = ("example_id", "answer", "task", "info")
"""Row fields a verifiers rollout input carries besides ``prompt``."""
