"""Episodes of several branches, where the loop meets them: a step's training rows and its metrics.

A generator returns one sample per episode; an agent episode whose session server recorded a
graph of turns carries its other branches in ``sample.branches`` (:class:`~miles_contracts.Branch`).
Rewards, filters, group statistics and over-sampling see the episode; only the step's training
batch expands it into rows (:meth:`~miles_contracts.Sample.rows`), all of them in the same step.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

from miles_contracts import ExitReason, Sample


def training_rows(groups: Iterable[Sequence[Sample]]) -> list[Sample]:
    """The trainable rows of the kept groups' trainable episodes, an episode's rows together.

    A linear episode is its own one row, so a run without branches trains exactly what it did.
    """
    return [row for group in groups for episode in group if episode.trainable
            for row in episode.rows() if row.trainable]


def has_branches(samples: Iterable[Sample]) -> bool:
    return any(s.branch is not None or s.branches for s in samples)


def episode_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """Branch metrics of a step's episodes; empty when no episode has a branch (linear runs log
    the keys they always did).

    - ``rollout/episode_rows_mean``: rows per episode;
    - ``rollout/role/<role>/rows``: rows of that role, and ``.../reward_mean`` the mean over
      episodes of the role's reward in the episode (an episode counts once per role, however many
      branches the role has in it: the same count group normalisation uses);
    - ``rollout/forks_<cause>``: branches by why they forked (the graph's count in
      ``metadata["episode"]["forks"]`` when the generator recorded one, else the rows' ``Branch.cause``;
      roots not counted);
    - ``rollout/retried_branches``: abandoned attempts (trained or not);
    - ``rollout/episode_limit``: episodes stopped by a per-episode limit (``ExitReason.EPISODE_LIMIT``).
    """
    if not has_branches(samples):
        return {}
    role_rows: Counter[str] = Counter()
    role_rewards: defaultdict[str, list[float]] = defaultdict(list)
    forks: Counter[str] = Counter()
    retried = 0
    total_rows = 0
    for episode in samples:
        rows = episode.rows()
        total_rows += len(rows)
        per_role: defaultdict[str, list[float]] = defaultdict(list)
        # the graph's own count when the generator recorded one: a branch that trains nothing (a
        # retried attempt, by default) has no row but was still a fork
        graph = episode.metadata.get("episode")
        recorded = graph.get("forks") if isinstance(graph, dict) else None
        counted = isinstance(recorded, dict)
        if isinstance(recorded, dict):
            forks.update({str(cause): int(n) for cause, n in recorded.items()})
            retried += int(recorded.get("retry", 0))
        for row in rows:
            if row.branch is None:
                continue
            role_rows[row.branch.role] += 1
            if row.reward is not None and math.isfinite(row.reward):
                per_role[row.branch.role].append(row.reward)
            if not counted and row.branch.cause != "root":
                forks[row.branch.cause] += 1
            retried += not counted and row.branch.retried
        for role, rewards in per_role.items():
            role_rewards[role].append(sum(rewards) / len(rewards))
    metrics = {
        "rollout/episode_rows_mean": total_rows / len(samples),
        "rollout/retried_branches": float(retried),
        "rollout/episode_limit": float(sum(s.exit_reason is ExitReason.EPISODE_LIMIT for s in samples)),
    }
    for role, count in role_rows.items():
        rewards = role_rewards.get(role, [])
        metrics[f"rollout/role/{role}/rows"] = float(count)
        metrics[f"rollout/role/{role}/reward_mean"] = sum(rewards) / len(rewards) if rewards else math.nan
    for cause, count in forks.items():
        metrics[f"rollout/forks_{cause}"] = float(count)
    return metrics
