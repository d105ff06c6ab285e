"""The embedded default: what ``miles train`` runs without a config file, and what it says about it.

With no config file the run is every section's defaults (:mod:`miles.sections`) with the few
:data:`SETTINGS` below on top: a GRPO run small enough for a CPU that still learns. Those few are
not section defaults because they are sized for this one run (a 135M model that must learn in 10
steps of 16 samples wants a learning rate 20x what RL on a larger model usually takes), and a
config file that leaves ``train.lr`` out should not inherit it. Its per-step reward
is the mean of 16 samples and jumps from step to step, so a newcomer is told at the start what the
reward measures and what it should do, and at the end what the measured runs did next to the
run's own trend (:meth:`miles.loop.progress.Progress.reward_trend`). The numbers come from
docs/benchmarks/learning-cpu.md, whose JSON records the settings it measured; a test keeps those
equal to the defaults. Overrides that change one of :data:`LEARNING_KEYS` void the expectation, and
the run says which ones did.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles.config import MilesConfig

SETTINGS: dict[str, dict[str, Any]] = {"run": {"steps": 10}, "train": {"lr": 2e-5}}
"""The embedded default's own values, over the section defaults (``miles config show`` prints the
result; :func:`miles.config.load_config` with no path starts from these)."""

BENCHMARK = "docs/benchmarks/learning-cpu.md"

LEARNING_KEYS: tuple[str, ...] = (
    "model.name", "data.source", "data.options", "data.template", "data.system_prompt", "data.apply_chat_template",
    "rollout.generator", "rollout.prompts_per_step", "rollout.samples_per_prompt", "rollout.max_new_tokens",
    "rollout.temperature", "rollout.top_p", "rollout.top_k", "rollout.filters", "reward.name", "algorithm",
    "train.policy_loss", "train.lr", "train.weight_decay", "train.betas", "train.warmup_steps", "train.lr_schedule",
    "train.grad_clip", "train.updates_per_step", "train.use_reference", "run.steps", "run.mode",
)
"""The settings the measured expectation depends on: dotted keys, a bare name for a whole section."""

# Measured (docs/benchmarks/learning-cpu.md): the mean rollout reward of steps 1-3 and of steps
# 8-10, lowest and highest of SEEDS runs.
SEEDS = 3
FIRST_STEPS = (0.25, 0.44)
LAST_STEPS = (0.56, 0.71)


def setting(config: dict[str, Any], key: str) -> Any:
    """The value of ``key`` (``"train.lr"``, or ``"algorithm"`` for a whole section) in ``config``,
    a config as :meth:`MilesConfig.to_dict` gives it."""
    node: Any = config
    for part in key.split("."):
        node = node[part]
    return node


def raw_settings() -> dict[str, Any]:
    """:data:`SETTINGS` as raw config data, a copy the caller may change."""
    return copy.deepcopy(SETTINGS)


def changed_settings(config: MilesConfig) -> list[str]:
    """The :data:`LEARNING_KEYS` whose value in ``config`` differs from the embedded default's."""
    from miles.config import load_config

    ours, default = config.to_dict(), load_config(None, check_names=False).to_dict()
    return [key for key in LEARNING_KEYS if setting(ours, key) != setting(default, key)]


def _range(bounds: tuple[float, float]) -> str:
    return f"{bounds[0]:.2f}-{bounds[1]:.2f}"


def introduction(config: MilesConfig) -> str:
    """What the run is and what its reward should do; printed before anything starts."""
    changed = changed_settings(config)
    if changed:
        return (f"no config file: the embedded default with {', '.join(changed)} changed. {BENCHMARK} measured "
                f"what the reward does with the defaults; with these settings there is no measured expectation.")
    r = config.rollout
    return "\n".join([
        "no config file: the embedded default. SmolLM2-135M-Instruct learns single-digit addition with GRPO,",
        f"  {config.run.steps} steps of {r.prompts_per_step} prompts x {r.samples_per_prompt} samples "
        f"(\"Compute 3 + 5. Reply with only the final number.\").",
        "reward: the share of sampled answers whose final number is the right sum. The model knows most sums",
        f"  but, sampling at temperature {r.temperature:g}, often talks on past its {r.max_new_tokens} tokens; "
        f"it learns to answer briefly.",
        f"  Measured ({SEEDS} runs, {BENCHMARK}): steps 1-3 average {_range(FIRST_STEPS)}, steps 8-10 "
        f"{_range(LAST_STEPS)}.",
        f"  {r.prompts_per_step * r.samples_per_prompt} samples a step make the reward jump about; the run ends "
        f"with its own averages.",
    ])


def closing(config: MilesConfig) -> str | None:
    """The measured expectation again, to read beside the run's own trend; None when it does not apply."""
    if changed_settings(config):
        return None
    return (f"measured for the embedded default ({SEEDS} runs): steps 1-3 {_range(FIRST_STEPS)} -> steps 8-10 "
            f"{_range(LAST_STEPS)}. The same run with a held-out evaluation: "
            f"uv run miles train examples/arithmetic/config.yaml")
