"""Console output of ``miles train``: a progress bar during rollout and one summary per step."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import TextIO


class Progress:
    def __init__(self, total_steps: int, stream: TextIO | None = None) -> None:
        self.total = total_steps
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._last = 0.0

    def message(self, text: str) -> None:
        self._clear()
        print(text, file=self.stream, flush=True)

    def rollout(self, step: int, done: int, total: int) -> None:
        """Redraw the bar (TTY) or print a line every 10% (logs)."""
        width = 30
        filled = int(width * done / max(total, 1))
        bar = "=" * filled + ">" * (filled < width) + " " * (width - filled - 1)
        text = f"step {step}/{self.total} rollout [{bar}] {done}/{total} samples"
        if self.tty:
            print("\r" + text, end="", file=self.stream, flush=True)
        elif done == total or time.monotonic() - self._last > 30:
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
            f"{g('perf/rollout_tokens_per_s', '.1f')} tok/s",
            f"time rollout {g('time/rollout', '.1f')}s train {g('time/train', '.1f')}s sync {g('time/sync', '.1f')}s",
        ]
        if "eval/accuracy" in m:
            parts.append(f"eval acc {g('eval/accuracy', '.3f')}")
        self.message(" | ".join(parts))

    def _clear(self) -> None:
        if self.tty:
            print("\r\033[K", end="", file=self.stream)
