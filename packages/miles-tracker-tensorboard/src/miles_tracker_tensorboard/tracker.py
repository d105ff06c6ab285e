"""``TensorBoardTracker``: scalars into ``runs/<name>/tensorboard/`` with tensorboardX.

Every metric becomes a scalar tagged by its name (``reward/mean``), flushed after each step so
``tensorboard --logdir runs/<name>/tensorboard`` shows a live run. tensorboardX replaces characters
TensorFlow does not allow in tags with ``_`` (``eval/pass@1`` appears as ``eval/pass_1``). Non-finite values
are skipped (TensorBoard would draw them as gaps anyway; ``metrics.jsonl`` keeps them as null).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles_contracts import RunContext

LOG_SUBDIR = "tensorboard"


class TensorBoardTracker:
    def __init__(self, logdir: Path) -> None:
        from tensorboardX import SummaryWriter

        self.logdir = logdir
        self._writer = SummaryWriter(logdir=str(logdir))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            value = float(value)
            if math.isfinite(value):
                self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def tensorboard_tracker(ctx: RunContext) -> TensorBoardTracker:
    """The tracker of the run of ``ctx`` (in the driver; it writes under the run folder)."""
    run_dir = ctx.require_run_dir("the tensorboard tracker")
    return TensorBoardTracker(run_dir / LOG_SUBDIR)
