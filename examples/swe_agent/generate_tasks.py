"""Generate the SWE-style task set: small Python repositories, each a module with one bug and a
``unittest`` suite that the bug fails, plus the prompt file ``tasks.jsonl``.

    python examples/swe_agent/generate_tasks.py            # writes tasks/ and tasks.jsonl
    python examples/swe_agent/generate_tasks.py --check    # also: buggy fails, fixed passes, per task

Twelve kinds of bug (an operator, a bound, an initial value, a missing case ...), three variants of
each (other names, constants and data): 36 tasks. A task's folder is what the sandbox copies into
the episode's workspace; ``fix.json`` (the fixed source, for ``--check``) is left out of it.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASKS = HERE / "tasks"
PROMPTS = HERE / "tasks.jsonl"


@dataclass(frozen=True)
class Task:
    name: str
    module: str
    buggy: str
    fixed: str
    tests: list[tuple[str, str]]  # (test name, body)
    issue: str

    def test_source(self) -> str:
        cases = "".join(f"\n    def test_{name}(self):\n        {body}\n" for name, body in self.tests)
        names = ", ".join(sorted(set(re.findall(r"^def (\w+)", self.buggy, re.M))))
        return f"import unittest\n\nfrom {self.module} import {names}\n\n\nclass {self.module.title().replace('_', '')}Test(unittest.TestCase):{cases}"


def _adder(i: int) -> Task:
    name = ["add", "plus", "total"][i]
    return Task(f"wrong-operator-{i}", f"arith{i}", f"def {name}(a, b):\n    return a - b\n",
                f"def {name}(a, b):\n    return a + b\n",
                [("small", f"self.assertEqual({name}(2, 3), 5)"), ("negative", f"self.assertEqual({name}(-1, 4), 3)"),
                 ("zero", f"self.assertEqual({name}(0, 0), 0)")],
                f"`{name}(2, 3)` in arith{i}.py returns -1 instead of 5.")


def _range_sum(i: int) -> Task:
    name = ["sum_to", "series", "triangle"][i]
    return Task(f"off-by-one-{i}", f"series{i}", f"def {name}(n):\n    return sum(range(n))\n",
                f"def {name}(n):\n    return sum(range(n + 1))\n",
                [("three", f"self.assertEqual({name}(3), 6)"), ("one", f"self.assertEqual({name}(1), 1)"),
                 ("zero", f"self.assertEqual({name}(0), 0)")],
                f"`{name}(n)` in series{i}.py should return 1 + 2 + ... + n, but `{name}(3)` gives 3.")


def _clamp(i: int) -> Task:
    hi = [10, 100, 255][i]
    return Task(f"clamp-bound-{i}", f"bounds{i}",
                f"def clamp(x):\n    if x < 0:\n        return 0\n    if x > {hi}:\n        return {hi - 1}\n    return x\n",
                f"def clamp(x):\n    if x < 0:\n        return 0\n    if x > {hi}:\n        return {hi}\n    return x\n",
                [("above", f"self.assertEqual(clamp({hi + 5}), {hi})"), ("below", "self.assertEqual(clamp(-3), 0)"),
                 ("inside", "self.assertEqual(clamp(7), 7)")],
                f"clamp() in bounds{i}.py should cap values at {hi}, but clamp({hi + 5}) returns {hi - 1}.")


def _maximum(i: int) -> Task:
    name = ["largest", "peak", "top"][i]
    return Task(f"initial-value-{i}", f"stats{i}",
                f"def {name}(values):\n    best = 0\n    for v in values:\n        if v > best:\n            best = v\n    return best\n",
                f"def {name}(values):\n    best = values[0]\n    for v in values:\n        if v > best:\n            best = v\n    return best\n",
                [("negative", f"self.assertEqual({name}([-5, -2, -9]), -2)"), ("mixed", f"self.assertEqual({name}([1, 7, 3]), 7)"),
                 ("single", f"self.assertEqual({name}([4]), 4)")],
                f"`{name}([-5, -2, -9])` in stats{i}.py returns 0; it should return -2.")


def _palindrome(i: int) -> Task:
    name = ["is_palindrome", "reads_same", "mirror"][i]
    return Task(f"palindrome-{i}", f"words{i}", f"def {name}(text):\n    t = text.lower()\n    return t == t\n",
                f"def {name}(text):\n    t = text.lower()\n    return t == t[::-1]\n",
                [("yes", f"self.assertTrue({name}('Level'))"), ("no", f"self.assertFalse({name}('python'))"),
                 ("empty", f"self.assertTrue({name}(''))")],
                f"`{name}('python')` in words{i}.py returns True.")


def _mean(i: int) -> Task:
    name = ["mean", "average", "avg"][i]
    return Task(f"integer-division-{i}", f"numbers{i}", f"def {name}(values):\n    return sum(values) // len(values)\n",
                f"def {name}(values):\n    return sum(values) / len(values)\n",
                [("half", f"self.assertEqual({name}([1, 2]), 1.5)"), ("whole", f"self.assertEqual({name}([2, 4]), 3)"),
                 ("one", f"self.assertEqual({name}([5]), 5)")],
                f"`{name}([1, 2])` in numbers{i}.py returns 1 instead of 1.5.")


def _vowels(i: int) -> Task:
    name = ["count_vowels", "vowels", "n_vowels"][i]
    return Task(f"missing-case-{i}", f"text{i}", f"def {name}(s):\n    return sum(c in 'aeio' for c in s.lower())\n",
                f"def {name}(s):\n    return sum(c in 'aeiou' for c in s.lower())\n",
                [("u", f"self.assertEqual({name}('sun'), 1)"), ("mixed", f"self.assertEqual({name}('Education'), 5)"),
                 ("none", f"self.assertEqual({name}('rhythm'), 0)")],
                f"`{name}('sun')` in text{i}.py returns 0: the vowel u is not counted.")


def _last(i: int) -> Task:
    name = ["last", "final", "tail_item"][i]
    return Task(f"wrong-index-{i}", f"seq{i}", f"def {name}(items):\n    return items[len(items) - 2]\n",
                f"def {name}(items):\n    return items[-1]\n",
                [("three", f"self.assertEqual({name}([1, 2, 3]), 3)"), ("one", f"self.assertEqual({name}(['x']), 'x')"),
                 ("two", f"self.assertEqual({name}([4, 5]), 5)")],
                f"`{name}([1, 2, 3])` in seq{i}.py returns 2, not the last item.")


def _fizz(i: int) -> Task:
    a, b = [(3, 5), (2, 7), (4, 6)][i]
    return Task(f"case-order-{i}", f"fizz{i}",
                f"def label(n):\n    if n % {a} == 0:\n        return 'Fizz'\n    if n % {b} == 0:\n        return 'Buzz'\n"
                f"    if n % {a * b} == 0:\n        return 'FizzBuzz'\n    return str(n)\n",
                f"def label(n):\n    if n % {a * b} == 0:\n        return 'FizzBuzz'\n    if n % {a} == 0:\n        return 'Fizz'\n"
                f"    if n % {b} == 0:\n        return 'Buzz'\n    return str(n)\n",
                [("both", f"self.assertEqual(label({a * b}), 'FizzBuzz')"), ("a", f"self.assertEqual(label({a}), 'Fizz')"),
                 ("plain", "self.assertEqual(label(1), '1')")],
                f"label({a * b}) in fizz{i}.py returns 'Fizz'; multiples of both {a} and {b} must be 'FizzBuzz'.")


def _title(i: int) -> Task:
    name = ["shout", "upper_name", "caps"][i]
    return Task(f"string-case-{i}", f"names{i}", f"def {name}(s):\n    return s.lower()\n", f"def {name}(s):\n    return s.upper()\n",
                [("word", f"self.assertEqual({name}('abc'), 'ABC')"), ("mixed", f"self.assertEqual({name}('aB'), 'AB')"),
                 ("empty", f"self.assertEqual({name}(''), '')")],
                f"`{name}('abc')` in names{i}.py should return 'ABC'.")


def _even(i: int) -> Task:
    name = ["evens", "even_only", "keep_even"][i]
    return Task(f"filter-condition-{i}", f"filters{i}", f"def {name}(xs):\n    return [x for x in xs if x % 2 == 1]\n",
                f"def {name}(xs):\n    return [x for x in xs if x % 2 == 0]\n",
                [("mixed", f"self.assertEqual({name}([1, 2, 3, 4]), [2, 4])"), ("none", f"self.assertEqual({name}([1, 3]), [])"),
                 ("zero", f"self.assertEqual({name}([0]), [0])")],
                f"`{name}([1, 2, 3, 4])` in filters{i}.py returns the odd numbers instead of the even ones.")


def _factorial(i: int) -> Task:
    name = ["factorial", "fact", "product_to"][i]
    return Task(f"base-case-{i}", f"recur{i}",
                f"def {name}(n):\n    if n == 0:\n        return 0\n    return n * {name}(n - 1)\n",
                f"def {name}(n):\n    if n == 0:\n        return 1\n    return n * {name}(n - 1)\n",
                [("zero", f"self.assertEqual({name}(0), 1)"), ("four", f"self.assertEqual({name}(4), 24)"),
                 ("one", f"self.assertEqual({name}(1), 1)")],
                f"`{name}(4)` in recur{i}.py returns 0 instead of 24.")


KINDS: list[Callable[[int], Task]] = [_adder, _range_sum, _clamp, _maximum, _palindrome, _mean, _vowels, _last,
                                      _fizz, _title, _even, _factorial]


def all_tasks() -> list[Task]:
    return [kind(i) for kind in KINDS for i in range(3)]


def write_repo(task: Task, folder: Path, *, fixed: bool = False) -> None:
    (folder / "tests").mkdir(parents=True)
    (folder / f"{task.module}.py").write_text(task.fixed if fixed else task.buggy)
    (folder / "tests" / "__init__.py").write_text("")
    (folder / "tests" / f"test_{task.module}.py").write_text(task.test_source())


def prompt_row(task: Task) -> dict[str, object]:
    return {"prompt": f"{task.issue} Fix the bug in the repository (in the current folder); the tests in tests/ "
                      "must pass (`python -m unittest`).",
            "label": task.name,
            "settings": {"env": {"task_id": task.name, "workspace": task.name},
                         "agent": {"tests": ["tests"], "n_tests": len(task.tests)}}}


def passes(folder: Path) -> bool:
    run = subprocess.run([sys.executable, "-m", "unittest", "-q"], cwd=folder, capture_output=True, timeout=60)
    return run.returncode == 0


def check(tasks: list[Task]) -> list[str]:
    """Names of tasks whose buggy repository passes or whose fix fails (should be none)."""
    bad = []
    with tempfile.TemporaryDirectory() as tmp:
        for task in tasks:
            buggy, fixed = Path(tmp) / task.name / "buggy", Path(tmp) / task.name / "fixed"
            write_repo(task, buggy)
            write_repo(task, fixed, fixed=True)
            if passes(buggy) or not passes(fixed):
                bad.append(task.name)
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="verify every task: its bug fails, its fix passes")
    args = parser.parse_args()
    tasks = all_tasks()
    shutil.rmtree(TASKS, ignore_errors=True)
    for task in tasks:
        write_repo(task, TASKS / task.name)
    PROMPTS.write_text("".join(json.dumps(prompt_row(t)) + "\n" for t in tasks))
    print(f"{len(tasks)} tasks in {TASKS.relative_to(Path.cwd()) if TASKS.is_relative_to(Path.cwd()) else TASKS}")
    if args.check:
        bad = check(tasks)
        print("every task checked" if not bad else f"broken tasks: {', '.join(bad)}")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
