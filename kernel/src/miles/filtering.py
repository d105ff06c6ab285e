"""Group filters as a pipeline, and the accounting for over-sampling.

``kept, drop_counts = apply_filters(groups, rollout.filters, kernel)`` runs the named filters in
config order on each prompt group; the first filter that drops a group decides its reason, and
later filters do not see it. ``OverSampler`` tells the loop how many groups to draw so that, after the filters, a step still
gets its batch; the loop decides what to do with the surplus (abort it, or keep it for the next
step).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from miles_contracts import FilterVerdict, Sample

from miles.errors import PluginError

if TYPE_CHECKING:
    from miles.kernel import Kernel

Group = Sequence[Sample]
DEFAULT_MAX_FACTOR = 8.0


class FilterResult(NamedTuple):
    """Groups that passed every filter (in their original order), and how many groups each reason
    dropped. Unpacks as ``kept, drop_counts``."""

    kept: list[Group]
    drop_counts: dict[str, int]

    def metrics(self) -> dict[str, float]:
        """``filter/drop_<reason>`` per reason, plus kept and dropped group counts."""
        out = {f"filter/drop_{reason}": float(n) for reason, n in self.drop_counts.items()}
        out["filter/kept_groups"] = float(len(self.kept))
        out["filter/dropped_groups"] = float(sum(self.drop_counts.values()))
        return out


def apply_filters(groups: Sequence[Group], names: Sequence[str], kernel: Kernel) -> FilterResult:
    """Run the filters ``names`` (registered names, in order) on every group.

    :raises UnknownNameError: a name is not a registered filter.
    :raises PluginError: a filter raised or returned something other than a ``FilterVerdict``
        (a filter bug stops the run rather than silently dropping or keeping groups).
    """
    registry = kernel.filters()
    filters = [(name, registry.get(name).check) for name in names]
    kept: list[Group] = []
    drops: Counter[str] = Counter()
    for index, group in enumerate(groups):
        for name, filter_fn in filters:
            try:
                verdict = filter_fn(group)
            except Exception as exc:
                raise PluginError(
                    f"filter {name!r} ({registry.entry(name).origin}) raised {type(exc).__name__} on group {index}: {exc}"
                ) from exc
            if not isinstance(verdict, FilterVerdict):
                raise PluginError(
                    f"filter {name!r} ({registry.entry(name).origin}) returned {verdict!r}; a filter returns "
                    f"miles_contracts.FilterVerdict(keep=..., reason=...)"
                )
            if not verdict.keep:
                drops[verdict.reason or name] += 1
                break
        else:
            kept.append(group)
    return FilterResult(kept, dict(drops))


@dataclass(slots=True)
class OverSampler:
    """How many prompt groups to draw so that ``needed`` of them survive the filters.

    The draw factor is ``rollout.over_sampling`` at least, and more when the filters have been
    dropping more than that allows: the keep rate is estimated from every step observed (an
    exponential average, newest step weighted ``smoothing``). A factor never exceeds ``max_factor``,
    so a run whose filters drop everything does not draw without bound.

    Loop use::

        draw = sampler.groups_to_draw(needed)        # first round of a step
        ... generate, score, filter ...
        sampler.observe(drawn=draw, kept=len(result.kept))
        draw = sampler.groups_to_draw(needed - kept)  # top-up round, if the loop wants one
    """

    factor: float = 1.0
    max_factor: float = DEFAULT_MAX_FACTOR
    smoothing: float = 0.5
    keep_rate: float | None = None  # estimate; None until a round was observed

    def __post_init__(self) -> None:
        if not 1.0 <= self.factor <= self.max_factor:
            raise ValueError(f"over-sampling factor {self.factor} must be within [1, max_factor={self.max_factor}]")
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"smoothing {self.smoothing} must be within (0, 1]")

    @property
    def draw_factor(self) -> float:
        if self.keep_rate is None:
            wanted = self.factor
        elif self.keep_rate == 0.0:
            wanted = self.max_factor
        else:
            wanted = 1.0 / self.keep_rate
        return min(self.max_factor, max(self.factor, wanted))

    def groups_to_draw(self, needed: int) -> int:
        """Groups to generate so that about ``needed`` pass the filters (0 when none are needed)."""
        if needed <= 0:
            return 0
        return max(needed, math.ceil(round(needed * self.draw_factor, 9)))

    def observe(self, drawn: int, kept: int) -> None:
        """Record that ``kept`` of ``drawn`` groups passed the filters."""
        if drawn <= 0:
            return
        if not 0 <= kept <= drawn:
            raise ValueError(f"kept ({kept}) must be within [0, drawn={drawn}]")
        rate = kept / drawn
        self.keep_rate = rate if self.keep_rate is None else self.smoothing * rate + (1 - self.smoothing) * self.keep_rate

    def metrics(self) -> dict[str, float]:
        out = {"filter/draw_factor": self.draw_factor}
        if self.keep_rate is not None:
            out["filter/keep_rate"] = self.keep_rate
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"keep_rate": self.keep_rate}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.keep_rate = state.get("keep_rate")


def over_sampler_for(over_sampling: float) -> OverSampler:
    """The sampler for ``rollout.over_sampling`` (the config allows any factor >= 1)."""
    return OverSampler(factor=over_sampling, max_factor=max(DEFAULT_MAX_FACTOR, over_sampling))
