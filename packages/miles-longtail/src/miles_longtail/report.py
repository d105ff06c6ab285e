"""What ``miles bench async`` reports, from the runs' ``metrics.jsonl`` rows.

A step's time is the interval between two consecutive step records (everything the loop does).
Step 1 is the warm-up -- it also fills the pipeline the later steps overlap with -- so the timed
span is steps 2..N: ``time_to_steps_s`` is the wall time from the end of step 1 to the end of
step N, ``samples_per_s`` the samples trained in those steps over that time. A mode's speedup is
sync's ``time_to_steps_s`` over its own, per repeat, and of the medians; beside it, the same
with the checkpoint saves in the span taken out (``saves_s``: the final save of a run with
``run.save_final`` is a fixed cost, equal in every mode, that weighs on a short run's ratio).

Whether a mode trains on what sync would: the response lengths of the samples each step trained
(``<run>/samples/step_*.jsonl``, rows with a ``batch_group``), pooled over a mode's repeats, against
sync's, as the two-sample Kolmogorov-Smirnov distance (the largest gap between the two empirical
distribution functions: 0 for the same distribution, 1 for disjoint ones). Discarding late groups
biases it toward short responses (a long rollout is the one that comes back late); the issue's goal
is <= 0.02. With few samples the distance of two draws of one distribution is itself large (about
1.36 * sqrt((n + m) / (n m)) at the 5 % level), so ``ks_noise_5pct`` is reported beside it.
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles.loop.buffer import SET_ASIDE_OUTCOMES

Rows = list[dict[str, Any]]

# The phases a step is made of, one after the other, in every mode (the others are parts of these:
# time/optimizer of time/train, time/sync_paused of time/sync; time/wait_batch is fully_async's
# time/rollout; time/dump runs beside training in one_step_off and fully_async, so it is no phase:
# sync's few ms of it fall to the unattributed rest). time/eval is one in sync and one_step_off, and
# not in fully_async, whose evaluations run in the background (their rows carry ``eval/step``).
# What a step's interval holds beyond their sum is ``unattributed_s``.
STEP_PHASES = ("time/rollout", "time/bookkeeping", "time/release", "time/train", "time/resume",
               "time/sync", "time/eval", "time/checkpoint", "time/router_metrics")


def _phases(row: dict[str, Any]) -> float:
    """The seconds of ``row``'s step that its sequential phases account for."""
    background = "eval/step" in row  # fully_async's evaluation: beside the steps, not in one
    return sum(row.get(k, 0.0) for k in STEP_PHASES if not (background and k == "time/eval"))


def run_summary(rows: Rows) -> dict[str, Any]:
    """Timing, throughput and learning of one run."""
    steps = sorted((r for r in rows if "step" in r and "time" in r), key=lambda r: r["step"])
    if len(steps) < 2:
        raise ValueError(f"a run needs at least 2 logged steps to be timed, got {len(steps)}")
    timed = steps[1:]
    span = steps[-1]["time"] - steps[0]["time"]
    intervals = [b["time"] - a["time"] for a, b in zip(steps, steps[1:], strict=False)]
    samples = sum(r.get("train/samples", 0.0) for r in timed)
    saves = sum(r.get("time/checkpoint", 0.0) for r in timed)
    return {
        "steps": len(steps),
        "time_to_steps_s": span,
        # checkpoint saves in the span (the final one with run.save_final): a fixed cost per save,
        # the same in every mode, which a short run's ratio would otherwise carry
        "saves_s": saves,
        "time_to_steps_excluding_saves_s": span - saves,
        "samples_per_s": samples / span if span > 0 else 0.0,
        "step_s": _spread(intervals),
        "wait_batch_s": _spread([r.get("time/rollout", 0.0) for r in timed]),
        # trajectories being generated when the trainer took its batch (fully_async)
        "in_flight_samples": _spread([r["async/in_flight_samples"] for r in timed if "async/in_flight_samples" in r]),
        "train_s": _spread([r.get("time/train", 0.0) for r in timed]),
        # every phase the loop timed (time/sync, time/logprobs, ...), median over the timed steps:
        # where a step's time goes beyond the wait for a batch and the train phase
        "phases_s": {k: statistics.median(r[k] for r in timed if k in r)
                     for k in sorted({k for r in timed for k in r if k.startswith("time/")})},
        # the same phases summed over the timed steps, and what the span holds beyond the steps'
        # phases (the loop's own work, and the event loop's delay in resuming the trainer): a median
        # of each phase does not add up to a step, a sum does
        "phase_totals_s": {k: sum(r.get(k, 0.0) for r in timed)
                           for k in sorted({k for r in timed for k in r if k.startswith("time/")})},
        "unattributed_s": span - sum(_phases(r) for r in timed),
        "rewards": [r.get("rollout/reward_mean") for r in steps],
        "step_end_s": [r["time"] - steps[0]["time"] for r in steps],
        "staleness_max": max((r.get("async/staleness_max", 0.0) for r in steps), default=0.0),
        "groups_set_aside": {k: sum(r.get(f"async/{k}", 0.0) for r in steps) for k in SET_ASIDE_OUTCOMES},
        "partial_samples": sum(r.get("async/partial_samples", 0.0) for r in steps),
    }


def trained_rows(run_dir: Path) -> list[dict[str, Any]]:
    """Every sample the run trained, as its step sample files hold it (rows with a ``batch_group``)."""
    rows = []
    for path in sorted((run_dir / "samples").glob("step_*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if row.get("batch_group") is not None:
                rows.append(row)
    return rows


def trained_lengths(rows: Sequence[dict[str, Any]]) -> list[int]:
    """Response lengths (tokens) of the trained samples."""
    return [int(row.get("response_tokens", 0)) for row in rows]


def turn_latencies(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """How long the trained samples' agent waited for the model, per turn (the ``long_tail`` agent's
    ``model_seconds``): the engine's latency under the mode's load, the other half of an episode
    beside its tool calls. ``{}`` for runs whose agent did not time its turns."""
    seconds = sorted(t for row in rows for t in ((row.get("metadata") or {}).get("agent_result") or {})
                     .get("model_seconds", []))
    if not seconds:
        return {}
    return {"median": statistics.median(seconds), "mean": statistics.fmean(seconds),
            "p90": seconds[int(0.9 * (len(seconds) - 1))], "max": seconds[-1], "turns": float(len(seconds))}


ENGINE_COUNTERS = ("decode_steps", "decode_tokens", "decode_seconds", "prefill_requests", "prefill_forwards",
                   "prefill_tokens", "cached_prefill_tokens", "prefill_seconds")


def engine_stats(run_dir: Path) -> dict[str, float]:
    """What the run's embedded engines did over their whole lives (the warm-up step included), from
    the statistics each writes to its log when it stops (``miles_engine.serve.STATS_PREFIX``),
    summed over engines and restarts: decode steps, their mean batch and milliseconds, prefill
    forwards (one per request when requests come with a cached prefix) and theirs. Where an
    engine's time goes when the rollout is the bottleneck. ``{}`` without such lines (another
    engine, or a run killed before its engines stopped)."""
    from miles_engine.serve import STATS_PREFIX

    totals = dict.fromkeys(ENGINE_COUNTERS, 0.0)
    found = False
    for path in sorted((run_dir / "logs").glob("engine-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith(STATS_PREFIX):
                try:
                    stats = json.loads(line[len(STATS_PREFIX):])
                except ValueError:  # cut short (the engine was killed as it wrote it): that life is not counted
                    continue
                for key in ENGINE_COUNTERS:
                    totals[key] += float(stats.get(key, 0.0))
                found = True
    if not found:
        return {}
    steps, forwards = totals["decode_steps"], totals["prefill_forwards"]
    return totals | {"mean_decode_batch": totals["decode_tokens"] / steps if steps else 0.0,
                     "decode_ms_per_step": 1000 * totals["decode_seconds"] / steps if steps else 0.0,
                     "prefill_ms_per_forward": 1000 * totals["prefill_seconds"] / forwards if forwards else 0.0}


def ks_distance(a: Sequence[float], b: Sequence[float]) -> float:
    """The two-sample Kolmogorov-Smirnov statistic: max over x of |F_a(x) - F_b(x)|."""
    if not a or not b:
        return float("nan")
    xs, ys = sorted(a), sorted(b)
    return max(abs(bisect.bisect_right(xs, v) / len(xs) - bisect.bisect_right(ys, v) / len(ys)) for v in xs + ys)


def ks_noise(n: int, m: int) -> float:
    """The KS distance two samples of sizes n and m of one distribution exceed 5 % of the time."""
    return 1.358 * math.sqrt((n + m) / (n * m)) if n and m else float("nan")


def _spread(values: Sequence[float]) -> dict[str, float]:
    """Median and the range of ``values`` (``{}`` when there are none)."""
    if not values:
        return {}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def compare(runs: dict[str, list[dict[str, Any]]], baseline: str = "sync") -> dict[str, Any]:
    """Per mode: medians over repeats, and the speedup over ``baseline`` (medians and per repeat)."""
    out: dict[str, Any] = {}
    base = runs.get(baseline)
    for mode, summaries in runs.items():
        times = [s["time_to_steps_s"] for s in summaries]
        entry: dict[str, Any] = {
            "repeats": len(summaries),
            "time_to_steps_s": _spread(times),
            "samples_per_s": _spread([s["samples_per_s"] for s in summaries]),
            "step_s_median": _spread([s["step_s"]["median"] for s in summaries]),
            "train_s_median": _spread([s["train_s"]["median"] for s in summaries if s["train_s"]]),
            "wait_batch_s_median": _spread([s["wait_batch_s"]["median"] for s in summaries if s["wait_batch_s"]]),
            "turn_latency_s_median": _spread([s["turn_latency_s"]["median"] for s in summaries
                                              if s.get("turn_latency_s")]),
            "unattributed_s": _spread([s["unattributed_s"] for s in summaries if "unattributed_s" in s]),
        }
        for key in ("decode_ms_per_step", "mean_decode_batch", "prefill_ms_per_forward"):  # the engines' side
            entry["engine_" + key] = _spread([s["engine"][key] for s in summaries if s.get("engine")])
        lengths = [n for s in summaries for n in s.get("trained_lengths", [])]
        entry["trained_length"] = _spread(lengths)
        entry["final_reward"] = _spread([_final_reward(s) for s in summaries])
        if base:
            base_times = [s["time_to_steps_s"] for s in base]
            entry["speedup_vs_" + baseline] = statistics.median(base_times) / statistics.median(times)
            entry["speedup_per_repeat"] = [b / t for b, t in zip(base_times, times, strict=False)]
            if all("time_to_steps_excluding_saves_s" in s for s in (*summaries, *base)):
                base_net = statistics.median(s["time_to_steps_excluding_saves_s"] for s in base)
                net = statistics.median(s["time_to_steps_excluding_saves_s"] for s in summaries)
                entry["speedup_excluding_saves_vs_" + baseline] = base_net / net if net > 0 else float("nan")
            base_lengths = [n for s in base for n in s.get("trained_lengths", [])]
            entry["ks_length_vs_" + baseline] = ks_distance(lengths, base_lengths)
            entry["ks_noise_5pct"] = ks_noise(len(lengths), len(base_lengths))
        out[mode] = entry
    return out


def _final_reward(summary: dict[str, Any], last: int = 3) -> float:
    """The mean rollout reward of a run's last ``last`` steps (one step's batch is noisy)."""
    rewards = [r for r in summary["rewards"][-last:] if r is not None]
    return statistics.fmean(rewards) if rewards else float("nan")


def plot(runs: dict[str, list[dict[str, Any]]], path: Path, title: str) -> None:
    """Reward per step and reward over wall time of each mode, side by side: the mean over repeats,
    with the range of the repeats shaded (left); the right panel places step k at the repeats' mean
    time to step k."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("--png needs matplotlib: pip install 'miles-longtail[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for mode, summaries in runs.items():
        steps = min(len(s["rewards"]) for s in summaries)
        rewards = [[s["rewards"][k] for s in summaries if s["rewards"][k] is not None] for k in range(steps)]
        mean = [statistics.fmean(r) if r else float("nan") for r in rewards]
        ends = [statistics.fmean(s["step_end_s"][k] for s in summaries) for k in range(steps)]
        line, = by_step.plot(range(1, steps + 1), mean, "o-", ms=3, label=f"{mode} ({len(summaries)} runs)")
        by_step.fill_between(range(1, steps + 1), [min(r, default=m) for r, m in zip(rewards, mean, strict=True)],
                             [max(r, default=m) for r, m in zip(rewards, mean, strict=True)], color=line.get_color(), alpha=0.15)
        by_time.plot(ends, mean, "o-", ms=3, color=line.get_color(), label=mode)
    by_step.set_xlabel("RL step")
    by_step.set_ylabel("rollout reward (batch mean)")
    by_time.set_xlabel("seconds since the end of step 1 (mean over runs)")
    by_step.set_title("reward per step (range of runs shaded)")
    by_time.set_title("reward over wall time")
    by_step.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
