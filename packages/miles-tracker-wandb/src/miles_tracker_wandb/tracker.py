"""``WandbTracker``: a Weights & Biases run per Miles run, its files under ``runs/<name>/wandb/``.

Offline mode (``wandb.mode: offline`` or ``WANDB_MODE=offline``) needs no network and no login;
upload later with ``wandb sync runs/<name>/wandb/offline-run-*``. The W&B run id is kept in
``runs/<name>/wandb-run-id`` so that ``miles train --resume`` continues the same W&B run. The
console is not captured (``console="off"``): it would interleave with Miles' progress bar.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from miles_tracker_wandb.config import WandbSection

if TYPE_CHECKING:
    from miles_contracts import RunContext

RUN_ID_FILE = "wandb-run-id"


class WandbTracker:
    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


def wandb_tracker(ctx: RunContext) -> WandbTracker:
    """The tracker of the run of ``ctx`` (in the driver; it writes under the run folder)."""
    config, run_dir = ctx.config, ctx.require_run_dir("the wandb tracker")
    import wandb

    section = config.section("wandb", WandbSection)
    run_dir.mkdir(parents=True, exist_ok=True)
    id_file = run_dir / RUN_ID_FILE
    run_id = id_file.read_text().strip() if id_file.exists() else None
    run = wandb.init(
        project=section.project or config.tracking.project,
        entity=section.entity,
        group=section.group,
        tags=section.tags or None,
        name=run_dir.name,
        id=run_id,
        resume="allow" if run_id else None,
        dir=str(run_dir),
        mode=section.mode,
        config=config.to_dict(),
        reinit="create_new",
        settings=wandb.Settings(console="off", silent=True),
    )
    id_file.write_text(run.id)
    return WandbTracker(run)
