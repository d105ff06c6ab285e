"""Read a step's dump (``<run>/samples/step_<n>.jsonl``, written by
:func:`miles.loop.run_dir.dump_samples`) back into samples: what ``miles replay`` trains on again
and re-scores.

A line is one episode; its other branches nest under ``branches``. Lines are JSON (never pickles),
checked as they are read: a folder can come from anyone, and a line that is not a sample is an
error naming the file and line.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from miles_contracts import Branch, ExitReason, Sample, Status

from miles.errors import MilesError
from miles.loop.episodes import training_rows
from miles.loop.run_dir import dump_path, dumped_steps

TOKEN_FIELDS = ("tokens", "loss_mask", "rollout_logprobs")


def dumped_lines(run_dir: Path, step: int) -> list[dict[str, Any]]:
    """The JSON lines of step ``step``'s dump."""
    path = dump_path(run_dir, step)
    if not path.is_file():
        steps = dumped_steps(run_dir)
        have = f"it has steps {steps[0]}..{steps[-1]}" if steps else "it has no step dumps"
        raise MilesError(f"{path} does not exist: {run_dir} has no dump of step {step} ({have})")
    lines = []
    for number, text in enumerate(path.read_text().splitlines(), 1):
        try:
            line = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MilesError(f"{path}:{number} is not JSON ({exc})") from None
        if not isinstance(line, dict):
            raise MilesError(f"{path}:{number} is not a sample (a JSON object per line is expected)")
        lines.append(line)
    return lines


def sample_from_line(line: dict[str, Any], *, where: str = "") -> Sample:
    """The :class:`Sample` a dump line describes (its nested branches included)."""
    try:
        sample = Sample(
            prompt=line["prompt"], label=line.get("label"), response=line.get("response", ""),
            response_length=int(line.get("response_tokens", 0)), reward=line.get("reward"),
            status=Status(line["status"]),
            exit_reason=ExitReason(line["exit_reason"]) if line.get("exit_reason") else None,
            exit_detail=line.get("exit_detail"), weight_versions=[int(v) for v in line.get("weight_versions", [])],
            group_index=int(line["group"]), index=int(line["index"]), metadata=dict(line.get("metadata") or {}),
            tokens=[int(t) for t in line.get("tokens", [])], loss_mask=[int(m) for m in line.get("loss_mask", [])],
            rollout_logprobs=[float(p) for p in line.get("rollout_logprobs", [])],
            token_versions=[int(v) for v in line.get("token_versions") or []],
            branch=Branch(**line["branch"]) if line.get("branch") else None,
            role_rewards={str(k): float(v) for k, v in (line.get("role_rewards") or {}).items()},
        )
        sample.branches = [sample_from_line(b, where=where) for b in line.get("branches", [])]
    except (KeyError, TypeError, ValueError) as exc:
        raise MilesError(f"{where}: not a sample line of a Miles dump ({type(exc).__name__}: {exc})") from None
    return sample


def dumped_episodes(run_dir: Path, step: int) -> list[tuple[Sample, int | None]]:
    """Every episode of step ``step`` in dump order, with the position of its group in the step's
    batch (None: the episode was not trained on: a filtered group, a surplus one, an aborted try)."""
    path = dump_path(run_dir, step)
    return [(sample_from_line(line, where=f"{path}:{n}"), line.get("batch_group"))
            for n, line in enumerate(dumped_lines(run_dir, step), 1)]


def batch_samples(run_dir: Path, step: int) -> list[Sample]:
    """The training rows of step ``step``, in the order the run's learner got them: the trained
    groups in batch order, each kept episode's trainable rows (:func:`~miles.loop.episodes.training_rows`)."""
    episodes = dumped_episodes(run_dir, step)
    path = dump_path(run_dir, step)
    if not any(position is not None for _, position in episodes):
        raise MilesError(f"{path} marks no episode as trained on (no batch_group): the step trained on nothing, or "
                         f"the run was written by a Miles from before dumps recorded the batch")
    groups: defaultdict[int, list[Sample]] = defaultdict(list)
    for episode, position in episodes:
        if position is not None:
            groups[int(position)].append(episode)
    rows = training_rows(groups[k] for k in sorted(groups))
    missing = [r.index for r in rows if not r.tokens]
    if missing:
        raise MilesError(f"{path} has no token ids (samples {missing[:5]}...): the run was started without "
                         f"run.dump_tokens=true, and a replay needs the tokens it trained on")
    return rows
