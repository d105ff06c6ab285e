"""The ``arithmetic`` task: an endless stream of integer arithmetic problems, and a held-out split.

``data.options``: ``digits`` (operands have up to this many digits; default 1), ``operands``
(default 2), ``operations`` (any of ``+ - *``; default ``[+]``), ``eval_fraction`` (share of all
problems held out; default 0.2) and ``instruction`` (the prompt, with ``{expression}``).

Problem ``i`` of the training stream is drawn from ``random.Random(f"...:{seed}:{i}")``, so the
stream is deterministic from ``data.seed`` and the position (one integer) is the whole state.
Whether a problem is held out depends only on its expression (a hash), never on the seed: the
training stream never shows a held-out problem, and every run evaluates on the same problems.

The default -- single-digit addition, "reply with only the final number" -- is what
SmolLM2-135M-Instruct can learn in a few GRPO steps: it answers about 70-80% of these correctly
when greedy, but only 20-30% when sampling at temperature 1, mostly for want of a bare number.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from miles_contracts import Sample
from pydantic import BaseModel, ConfigDict, Field

from miles.data.errors import DataError
from miles.data.file_source import parse_options
from miles.data.prompts import PromptSpec

if TYPE_CHECKING:
    from miles_contracts import RunContext

    from miles.sections import DataSection

ENUMERATE_UP_TO = 200_000  # problem spaces this small are listed in full for the eval split
MAX_DRAWS = 10_000


Operation = Literal["+", "-", "*"]


class ArithmeticOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    digits: int = Field(default=1, ge=1, le=6, description="operands have up to this many digits")
    operands: int = Field(default=2, ge=2, le=4)
    operations: list[Operation] = Field(default_factory=lambda: list[Operation](["+"]), min_length=1)
    eval_fraction: float = Field(default=0.2, gt=0.0, lt=1.0, description="share of all problems held out for evaluation")
    instruction: str = Field(default="Compute {expression}. Reply with only the final number.", pattern=r"\{expression\}")


@dataclass(frozen=True, slots=True)
class Problem:
    operands: tuple[int, ...]
    operations: tuple[str, ...]  # one fewer than operands

    @property
    def expression(self) -> str:
        parts = [str(self.operands[0])]
        for operation, operand in zip(self.operations, self.operands[1:], strict=True):
            parts += [operation, str(operand)]
        return " ".join(parts)

    @property
    def answer(self) -> int:
        """Value with the usual precedence: products first, then sums and differences."""
        terms, signs = [self.operands[0]], [1]
        for operation, operand in zip(self.operations, self.operands[1:], strict=True):
            if operation == "*":
                terms[-1] *= operand
            else:
                terms.append(operand)
                signs.append(1 if operation == "+" else -1)
        return sum(sign * term for sign, term in zip(signs, terms, strict=True))


class ArithmeticTask:
    """A :class:`miles_contracts.DataSource` with a held-out split (``eval_prompts``)."""

    def __init__(self, options: ArithmeticOptions, spec: PromptSpec, *, seed: int) -> None:
        self.options = options
        self.spec = spec
        self.seed = seed
        self.position = 0
        self._space = 10 ** (options.digits * options.operands) * len(options.operations) ** (options.operands - 1)
        if self._space <= ENUMERATE_UP_TO and all(self.is_held_out(p) for p in self._all_problems()):
            raise DataError("every arithmetic problem of these data.options is held out; lower data.options.eval_fraction")

    @classmethod
    def open(cls, ctx: RunContext, config: DataSection) -> ArithmeticTask:
        """The task the ``data`` section describes (the ``arithmetic`` data source's factory)."""
        return cls(parse_options(ArithmeticOptions, config), PromptSpec.from_config(config, prompt_key="prompt", label_key="label"), seed=config.seed)

    # ------------------------------------------------------------------ problems

    def is_held_out(self, problem: Problem) -> bool:
        digest = hashlib.sha256(problem.expression.encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < self.options.eval_fraction

    def _draw(self, rng: random.Random) -> Problem:
        bound = 10**self.options.digits
        operands = tuple(rng.randrange(bound) for _ in range(self.options.operands))
        operations = tuple(rng.choice(self.options.operations) for _ in range(self.options.operands - 1))
        return Problem(operands, operations)

    def _all_problems(self) -> Any:
        numbers = range(10**self.options.digits)
        for operands in itertools.product(numbers, repeat=self.options.operands):
            for operations in itertools.product(self.options.operations, repeat=self.options.operands - 1):
                yield Problem(operands, operations)

    def training_problem(self, index: int) -> Problem:
        rng = random.Random(f"miles-arithmetic:{self.seed}:{index}")
        for _ in range(MAX_DRAWS):
            problem = self._draw(rng)
            if not self.is_held_out(problem):
                return problem
        raise DataError("cannot draw a training problem that is not held out; lower data.options.eval_fraction")

    def held_out_problems(self, n: int) -> list[Problem]:
        """``n`` distinct held-out problems (fewer if the split has fewer), the same in every run."""
        rng = random.Random("miles-arithmetic-eval")
        if self._space <= ENUMERATE_UP_TO:
            held_out = [p for p in self._all_problems() if self.is_held_out(p)]
            rng.shuffle(held_out)
            return held_out[:n]
        found: dict[str, Problem] = {}
        for _ in range(MAX_DRAWS * max(n, 1)):
            if len(found) == n:
                break
            problem = self._draw(rng)
            if self.is_held_out(problem):
                found.setdefault(problem.expression, problem)
        return list(found.values())

    def _sample(self, problem: Problem, split: str, **extra: Any) -> Sample:
        fields = {"prompt": self.options.instruction.format(expression=problem.expression), "label": problem.answer}
        record = self.spec.build(fields)
        return record.to_sample(task="arithmetic", expression=problem.expression, split=split, **extra)

    # ------------------------------------------------------------------ DataSource

    def next_prompts(self, n: int) -> list[Sample]:
        samples = [self._sample(self.training_problem(self.position + i), "train", data_index=self.position + i)
                   for i in range(n)]
        self.position += n
        return samples

    def eval_prompts(self, n: int) -> list[Sample]:
        problems = self.held_out_problems(n)
        if not problems:
            raise DataError("the arithmetic eval split is empty for these data.options; raise data.options.eval_fraction")
        return [self._sample(problem, "eval") for problem in problems]

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed, "options": self.options.model_dump(mode="json")}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = (state.get("seed"), state.get("options"))
        if saved != (self.seed, self.options.model_dump(mode="json")):
            raise DataError(
                f"the saved arithmetic position is for seed {saved[0]} and options {saved[1]}, but this run has seed "
                f"{self.seed} and options {self.options.model_dump(mode='json')}; resuming would not continue the same "
                f"stream. Use the original data.seed / data.options, or start a new run"
            )
        self.position = int(state["position"])

    def metrics(self) -> dict[str, float]:
        return {"data/position": float(self.position)}
