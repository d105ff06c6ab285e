"""Built-in plugin ``filters``: ``zero_variance``, ``no_aborted`` and ``no_truncated``.

Each is a group filter ``(group) -> FilterVerdict`` (see ``miles_register_filters``); the loop
composes the ones named in ``rollout.filters`` with :func:`miles.filtering.apply_filters`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from miles_contracts import FilterSpec, FilterVerdict, Sample, Status

from miles.hookspecs import hookimpl
from miles.registry import Register

KEEP = FilterVerdict(keep=True)
# Rewards closer than this count as equal (float noise from averaging rewards).
MIN_REWARD_STD = 1e-8


def zero_variance(group: Sequence[Sample]) -> FilterVerdict:
    """Drop a group whose rewards are all equal: every advantage would be zero, so it teaches
    nothing (reason ``zero_std``). Samples without a reward do not count; fewer than two rewards
    is no variance either."""
    rewards = [s.reward for s in group if s.reward is not None and math.isfinite(s.reward)]
    if len(rewards) < 2 or statistics.pstdev(rewards) <= MIN_REWARD_STD:
        return FilterVerdict(keep=False, reason="zero_std")
    return KEEP


def no_aborted(group: Sequence[Sample]) -> FilterVerdict:
    """Drop a group with any ABORTED (reason ``aborted``) or FAILED (reason ``failed``) sample:
    group-relative advantages need every member of the group."""
    statuses = {s.status for s in group}
    if Status.ABORTED in statuses:
        return FilterVerdict(keep=False, reason="aborted")
    if Status.FAILED in statuses:
        return FilterVerdict(keep=False, reason="failed")
    return KEEP


def no_truncated(group: Sequence[Sample]) -> FilterVerdict:
    """Drop a group with any TRUNCATED sample (reason ``truncated``): its reward judges an
    answer the model never finished."""
    if any(s.status is Status.TRUNCATED for s in group):
        return FilterVerdict(keep=False, reason="truncated")
    return KEEP


@hookimpl
def miles_register_filters(register: Register[FilterSpec]) -> None:
    register("zero_variance", FilterSpec(zero_variance))
    register("no_aborted", FilterSpec(no_aborted))
    register("no_truncated", FilterSpec(no_truncated))
