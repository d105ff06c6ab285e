"""What the RL loop calls: open the configured data source, draw held-out prompts, read metrics."""

from __future__ import annotations

from collections.abc import Sized
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from miles_contracts import DataSource, Sample

from miles.data.errors import DataError

if TYPE_CHECKING:
    from miles_contracts import RunContext

    from miles.sections import DataSection


@runtime_checkable
class HasEvalSplit(Protocol):
    """A source that holds prompts out of training itself (task generators)."""

    def eval_prompts(self, n: int) -> list[Sample]: ...


@runtime_checkable
class ReportsMetrics(Protocol):
    """A source with metrics of its own (epoch, skipped records ...)."""

    def metrics(self) -> dict[str, float]: ...


def open_data_source(ctx: RunContext, config: DataSection | None = None) -> DataSource:
    """The source named by ``data.source``, opened from ``config`` (default: the run's ``data`` section)."""
    config = config if config is not None else ctx.config.data
    return ctx.kernel.data_sources().get(config.source).open(ctx, config)


def eval_prompts(ctx: RunContext, limit: int, *, source: DataSource | None = None,
                 config: DataSection | None = None) -> list[Sample]:
    """Up to ``limit`` held-out prompts, the same ones at every call (``metadata["split"] == "eval"``).

    From ``data.eval_path`` when set (read by the same source kind, in file order, the first
    ``limit``); otherwise from the training source's own held-out split (``source``, or a fresh one).
    """
    config = config if config is not None else ctx.config.data
    if config.eval_path:
        held_out = open_data_source(ctx, config.model_copy(update={"path": config.eval_path, "shuffle": False}))
        count = min(limit, len(held_out)) if isinstance(held_out, Sized) else limit
        samples = held_out.next_prompts(count)
        for sample in samples:
            sample.metadata["split"] = "eval"
        return samples
    source = source if source is not None else open_data_source(ctx, config)
    if not isinstance(source, HasEvalSplit):
        raise DataError(
            f"data source {config.source!r} has no held-out split of its own: set data.eval_path to a file of held-out prompts "
            f"(or turn evaluation off with eval.every=0)"
        )
    return source.eval_prompts(limit)


def source_metrics(source: DataSource) -> dict[str, float]:
    """The source's own metrics, or none."""
    return source.metrics() if isinstance(source, ReportsMetrics) else {}
