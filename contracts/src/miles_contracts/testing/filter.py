"""Conformance suite for group filters: ``check_filter(fn)``.

A filter (see :class:`miles_contracts.Filter`) must

- return a :class:`FilterVerdict` for every group: uniform or mixed rewards, unscored, aborted,
  failed and truncated samples, a group of one;
- give a reason when it drops a group: a short ``snake_case`` word, because it becomes the metric
  ``filter/drop_<reason>``;
- decide the same way every time, for a list or a tuple of the same samples;
- leave the samples unchanged.

Usage::

    from miles_contracts.testing.filter import check_filter

    def test_my_filter_conforms():
        check_filter(my_filter)
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence

from miles_contracts.protocols import Filter, FilterVerdict
from miles_contracts.sample import ExitReason, Sample, Status
from miles_contracts.specs import FilterSpec

REASON = re.compile(r"^[a-z][a-z0-9_]*$")


def _group(rewards: Sequence[float | None], statuses: Sequence[Status] | None = None, group_index: int = 0) -> list[Sample]:
    statuses = statuses or [Status.COMPLETED] * len(rewards)
    samples = []
    for i, (reward, status) in enumerate(zip(rewards, statuses, strict=True)):
        sample = Sample(prompt="What is 2 + 2?", label="4", response=str(i), reward=reward, group_index=group_index, index=i)
        sample.tokens, sample.response_length, sample.loss_mask = [1, 2, 3], 1, [1]
        reason = {Status.ABORTED: ExitReason.ABORT, Status.FAILED: ExitReason.REWARD_ERROR, Status.TRUNCATED: ExitReason.LENGTH}
        sample.finish(status, reason.get(status, ExitReason.STOP))
        samples.append(sample)
    return samples


def typical_groups() -> list[list[Sample]]:
    """Groups a filter meets in a run (each of four samples unless said otherwise)."""
    return [
        _group([1.0, 0.0, 1.0, 0.0]),
        _group([1.0, 1.0, 1.0, 1.0]),
        _group([0.0, 0.0, 0.0, 0.0]),
        _group([0.25, 0.5, 0.75, 1.0]),
        _group([1.0, None, 0.0, 1.0], [Status.COMPLETED, Status.ABORTED, Status.COMPLETED, Status.COMPLETED]),
        _group([1.0, None, 0.0, 1.0], [Status.COMPLETED, Status.FAILED, Status.COMPLETED, Status.COMPLETED]),
        _group([1.0, 0.0, 0.0, 1.0], [Status.COMPLETED, Status.TRUNCATED, Status.COMPLETED, Status.COMPLETED]),
        _group([None, None, None, None], [Status.ABORTED] * 4),
        _group([0.5]),
    ]


def check_filter(filter_: FilterSpec | Filter, groups: Sequence[Sequence[Sample]] | None = None) -> None:
    """Raise ``AssertionError`` naming the first rule the filter breaks.

    :param filter_: what the plugin registers (a :class:`~miles_contracts.FilterSpec`), or the
        filter function itself.
    :param groups: groups to try besides :func:`typical_groups`.
    """
    fn = filter_.check if isinstance(filter_, FilterSpec) else filter_
    name = getattr(fn, "__name__", type(fn).__name__)
    for number, group in enumerate([*typical_groups(), *(list(g) for g in groups or ())]):
        before = [copy.deepcopy(s.to_dict()) for s in group]
        verdict = fn(group)
        where = f"filter {name} on group {number} (rewards {[s.reward for s in group]}, statuses {[s.status.value for s in group]})"
        assert isinstance(verdict, FilterVerdict), f"{where} returned {verdict!r}; expected a FilterVerdict"
        assert isinstance(verdict.keep, bool), f"{where}: FilterVerdict.keep is {verdict.keep!r}; expected True or False"
        if not verdict.keep:
            assert isinstance(verdict.reason, str) and REASON.match(verdict.reason), (
                f"{where} dropped the group with reason {verdict.reason!r}; a drop needs a snake_case reason "
                f"(it becomes the metric filter/drop_<reason>)"
            )
        assert [s.to_dict() for s in group] == before, f"{where} modified the samples"
        again = fn(tuple(group))
        assert again == verdict, f"{where} decided {verdict} first and {again} for the same samples as a tuple"
