"""Console output of ``miles train``: a progress bar during rollout, one summary per step, and at
the end how the rollout reward moved over the run."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TextIO


@dataclass(frozen=True, slots=True)
class RolloutProgress:
    """Where one step's rollout is, as :meth:`~miles.loop.rollout.RolloutManager.collect` reports
    it: at the start of each round and after each finished sample.

    :ivar done: samples finished this step.
    :ivar total: samples drawn so far this step; a top-up round (the filters dropped groups) draws
        more, so it grows between rounds.
    :ivar round: the over-sampling round, from 1.
    :ivar groups_drawn: prompt groups drawn so far this step.
    :ivar groups_wanted: ``rollout.prompts_per_step``, the groups the step trains on.
    :ivar groups_kept: groups the filters kept in the rounds before this one.
    """

    done: int
    total: int
    round: int = 1
    groups_drawn: int = 0
    groups_wanted: int = 0
    groups_kept: int = 0

    @property
    def note(self) -> str:
        """Why more groups than the step trains on are being generated; empty when none are."""
        if self.round > 1:
            return (f"top-up round {self.round}: the filters kept {self.groups_kept}/{self.groups_wanted} groups, "
                    f"{self.groups_drawn} drawn")
        if self.groups_drawn > self.groups_wanted:
            return f"over-sampling: {self.groups_drawn} groups drawn for {self.groups_wanted}"
        return ""


class Progress:
    def __init__(self, total_steps: int, stream: TextIO | None = None) -> None:
        self.total = total_steps
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._last = 0.0
        self._round: tuple[int, int] = (0, 0)  # (step, round) last reported
        self.rewards: dict[int, float] = {}  # step -> rollout/reward_mean, for reward_trend

    def message(self, text: str) -> None:
        self._clear()
        print(text, file=self.stream, flush=True)

    def rollout(self, step: int, p: RolloutProgress) -> None:
        """Redraw the bar (TTY) or print a line every 30 s, when a top-up round grows the total, and
        at the end (logs). The bar counts samples; its note says when and why the total grew."""
        width = 30
        filled = int(width * p.done / max(p.total, 1))
        bar = "=" * filled + ">" * (filled < width) + " " * (width - filled - 1)
        text = f"step {step}/{self.total} rollout [{bar}] {p.done}/{p.total} samples"
        if p.note:
            text += f" ({p.note})"
        new_round = (step, p.round) != self._round
        self._round = (step, p.round)
        if self.tty:
            print("\r\033[K" + text, end="", file=self.stream, flush=True)
        elif p.done == p.total or (new_round and p.round > 1) or time.monotonic() - self._last > 30:
            self._last = time.monotonic()
            print(text, file=self.stream, flush=True)

    def step(self, step: int, m: Mapping[str, float]) -> None:
        def g(key: str, fmt: str = ".3f") -> str:
            value = m.get(key)
            return "-" if value is None else format(value, fmt)

        parts = [
            f"step {step}/{self.total}",
            f"reward {g('rollout/reward_mean')}",
            f"acc {g('rollout/accuracy', '.2f')}",
            f"groups {g('rollout/groups_kept', '.0f')}/{g('rollout/groups_generated', '.0f')}",
            f"lp_diff {g('train/train_rollout_logprob_abs_diff', '.1e')}",
            f"loss {g('train/loss', '.4f')}",
            # perf/rollout_tokens_per_s: response tokens of every sample the step generated (kept or
            # filtered out) per second of its rollout's wall time (fully_async: the batch's tokens
            # over the time since the previous batch); not the engine's decode speed
            f"{g('perf/rollout_tokens_per_s', '.1f')} generated tok/s",
            f"time rollout {g('time/rollout', '.1f')}s train {g('time/train', '.1f')}s sync {g('time/sync', '.1f')}s",
        ]
        if "eval/accuracy" in m:
            parts.append(f"eval acc {g('eval/accuracy', '.3f')}")
        reward = m.get("rollout/reward_mean")
        if reward is not None and math.isfinite(reward):
            self.rewards[step] = reward
        self.message(" | ".join(parts))

    def reward_trend(self) -> str | None:
        """The mean rollout reward of the first and of the last steps this process ran (a third of
        them, 3 at most), or None before two steps. One step's reward is the mean of a few samples
        and jumps from step to step; a window of steps shows where the run went."""
        steps = sorted(self.rewards)
        if len(steps) < 2:
            return None
        n = min(3, max(1, len(steps) // 3))

        def window(chosen: list[int]) -> str:
            label = f"step {chosen[0]}" if len(chosen) == 1 else f"steps {chosen[0]}-{chosen[-1]}"
            return f"{label} {sum(self.rewards[s] for s in chosen) / len(chosen):.3f}"

        return f"rollout reward (mean): {window(steps[:n])} -> {window(steps[-n:])}"

    def _clear(self) -> None:
        if self.tty:
            print("\r\033[K", end="", file=self.stream)
