"""Writes train.jsonl / test.jsonl: short word problems with integer answers (deterministic).

    python examples/math_word_problems/make_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun"]
ITEMS = ["apples", "books", "coins", "marbles", "pencils", "stamps", "shells", "cards"]


def problem(rng: random.Random) -> dict[str, str]:
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    a, b, c = rng.randint(2, 30), rng.randint(2, 20), rng.randint(2, 6)
    kind = rng.randrange(4)
    if kind == 0:
        q, ans = f"{name} has {a} {item}. {other} gives {name} {b} more. How many {item} does {name} have now?", a + b
    elif kind == 1:
        a = a + b
        q, ans = f"{name} had {a} {item} and gave {b} of them to {other}. How many {item} does {name} have left?", a - b
    elif kind == 2:
        q, ans = f"{name} buys {c} boxes with {b} {item} in each box. How many {item} is that in total?", b * c
    else:
        total = b * c
        q, ans = f"{name} shares {total} {item} equally among {c} friends. How many {item} does each friend get?", b
    return {"question": q, "answer": str(ans)}


def main() -> None:
    here = Path(__file__).parent
    rng = random.Random(2026)
    rows = [problem(rng) for _ in range(240)]
    for name, part in (("train.jsonl", rows[:200]), ("test.jsonl", rows[200:])):
        with (here / name).open("w") as f:
            for row in part:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
