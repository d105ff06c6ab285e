"""Redo in place: in a ``run.deterministic`` run, a group that a fault of the rollout side spoiled
(an engine, router, session server, reward worker or sandbox died under it) is generated again
with the same prompt, the same sample indices and so the same sampling seeds, instead of being
filtered and replaced by the over-sampler with other prompts.

Why: the over-sampler's replacements have other data indices and other sample ids, hence other
``sampling_seed``\\ s, so the step's batch (and every weight after it) would differ from a run
without the fault. A deterministic engine computes a request the same whatever else it serves,
so the group redone once the services are back (and a restarted engine has the trainer's
weights) yields the very tokens the fault-free run trained on. docs/design/async.md, "Redo in place".

Runs in the driver, inside :meth:`miles.loop.rollout.RolloutManager.collect`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from miles_contracts import ExitReason, Sample, Status

REDO_ATTEMPTS = 4
"""Generations of one group after the first: a fault that persists (a reward that raises on this
sample every time, an engine that refuses the request) is then taken for what it is, and the group
goes to the filters as a run without redo would have sent it."""

REDO_REASON = "redo"
"""The ledger's ``recycled`` reason of a group generated again in place."""

INFRASTRUCTURE_EXITS = frozenset({
    ExitReason.ABORT,  # the engine or router went away with the request
    ExitReason.ENGINE_ERROR,  # refused connection, a 5xx, a session that could not be opened
    ExitReason.REWARD_ERROR,  # a killed reward worker: its batch missed reward.timeout
    ExitReason.TIMEOUT,
    ExitReason.AGENT_EXCEPTION,  # the agent's calls to a dead session server raised
    ExitReason.TOOL_ERROR,  # a dead sandbox
})
"""Exit reasons a dead service causes; the budgets' exits (wall clock, token, tool timeouts) are
the episode's own doing and are not redone."""


def spoiled_by_a_fault(group: Sequence[Sample]) -> bool:
    """A sample of ``group`` ended ABORTED or FAILED for a reason a dead service causes."""
    return any(s.status in (Status.ABORTED, Status.FAILED) and s.exit_reason in INFRASTRUCTURE_EXITS
               for s in group)


def pristine(groups: Sequence[Sequence[Sample]]) -> list[list[Sample]]:
    """Copies of ``groups`` as drawn, before the generator fills them in (generators write into
    the sample they are given): what a redo starts from."""
    return [[copy.deepcopy(s) for s in group] for group in groups]


__all__ = ["INFRASTRUCTURE_EXITS", "REDO_ATTEMPTS", "REDO_REASON", "pristine", "spoiled_by_a_fault"]
