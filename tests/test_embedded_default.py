"""What `miles train` without a config file tells a newcomer: the expectation it prints is the one
docs/benchmarks/learning-cpu.md measured, for the settings it measured, and only for those."""

from __future__ import annotations

import json
from pathlib import Path

from miles.config import load_config
from miles.embedded_default import (
    FIRST_STEPS,
    LAST_STEPS,
    LEARNING_KEYS,
    SEEDS,
    closing,
    introduction,
    setting,
)

ROOT = Path(__file__).resolve().parents[1]
MEASURED = json.loads((ROOT / "docs" / "benchmarks" / "learning-cpu.json").read_text())["variants"]["default"]


def test_the_defaults_are_the_settings_the_benchmark_measured() -> None:
    """Change a default the reward depends on and this fails: measure again
    (scripts/learning/default_cpu.py) before the run promises anything."""
    defaults = load_config().to_dict()
    assert MEASURED["settings"] == {key: setting(defaults, key) for key in LEARNING_KEYS}
    # the numbers printed are the measured ones, lowest and highest seed
    ranges = MEASURED["range_over_seeds"]
    assert tuple(round(x, 2) for x in ranges["reward_first_3"]) == FIRST_STEPS
    assert tuple(round(x, 2) for x in ranges["reward_last_3"]) == LAST_STEPS
    assert len(MEASURED["runs"]) == SEEDS >= 3 and all(len(run["reward_per_step"]) == 10 for run in MEASURED["runs"])


def test_the_first_run_says_what_its_reward_measures_and_what_it_should_do() -> None:
    config = load_config(None, ["run.output_dir=elsewhere", "run.name=first"])  # where a run goes changes nothing
    text = introduction(config)
    assert text.startswith("no config file: the embedded default. SmolLM2-135M-Instruct learns single-digit addition")
    assert "reward: the share of sampled answers whose final number is the right sum" in text
    first, last = (f"{low:.2f}-{high:.2f}" for low, high in (FIRST_STEPS, LAST_STEPS))
    assert f"steps 1-3 average {first}, steps 8-10 {last}" in text
    assert f"steps 1-3 {first} -> steps 8-10 {last}" in (closing(config) or "")


def test_overrides_of_what_was_measured_void_the_expectation_and_are_named() -> None:
    config = load_config(None, ["run.steps=4", "train.lr=1e-6", "run.output_dir=elsewhere"])
    assert introduction(config) == (
        "no config file: the embedded default with train.lr, run.steps changed. docs/benchmarks/learning-cpu.md "
        "measured what the reward does with the defaults; with these settings there is no measured expectation.")
    assert closing(config) is None
