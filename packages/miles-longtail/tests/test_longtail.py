"""The long-tail workload's draws, its reward, and the benchmark report's arithmetic."""

from __future__ import annotations

import math
import statistics

import pytest
from miles_contracts import Sample
from miles_longtail.agent import repeated_tokens
from miles_longtail.report import compare, run_summary
from miles_longtail.workload import LongTailSection, episode


def test_episodes_depend_only_on_seed_and_sample_index() -> None:
    settings = LongTailSection(turns=3)
    assert episode(settings, 7) == episode(LongTailSection(turns=3), 7)
    assert episode(settings, 7) != episode(settings, 8)
    assert episode(settings, 7) != episode(LongTailSection(turns=3, seed=1), 7)
    plan = episode(settings, 7)
    assert len(plan.tokens) == 3 and len(plan.latencies) == 2 and plan.tool_seconds == sum(plan.latencies)


def test_tool_latency_and_turn_lengths_are_heavy_tailed_and_bounded() -> None:
    settings = LongTailSection(turns=2, latency_scale=0.1, latency_alpha=1.3, latency_max=30.0, tokens_max=64)
    plans = [episode(settings, i) for i in range(4000)]
    latencies = sorted(lat for p in plans for lat in p.latencies)
    median = statistics.median(latencies)
    assert latencies[0] >= 0.1 and latencies[-1] <= 30.0
    assert latencies[int(0.99 * len(latencies))] > 20 * median  # the tail: a few calls take far longer
    tokens = [t for p in plans for t in p.tokens]
    assert min(tokens) >= 2 and max(tokens) == 64 and statistics.median(tokens) == pytest.approx(12, abs=1)


def test_repeated_tokens_scores_only_what_the_model_sampled() -> None:
    # prompt [1]; response 2 2 5 5, the third a tool token: sampled 2 (after 1), 2 (after 2), 5 (after 5)
    turn = Sample(tokens=[1, 2, 2, 5, 5], response_length=4, loss_mask=[1, 1, 0, 1])
    nothing = Sample(tokens=[1], response_length=0)
    rewards = repeated_tokens([turn, nothing])
    assert rewards[0] == pytest.approx(2 / 3) and math.isnan(rewards[1])


def _rows(step_times: list[float], samples: float = 16.0) -> list[dict]:
    return [{"step": i + 1, "time": t, "train/samples": samples, "rollout/reward_mean": 0.5,
             "time/train": 1.0 if i else 9.0} for i, t in enumerate(step_times)]


def test_the_report_times_steps_after_the_warm_up_and_compares_with_sync() -> None:
    sync = run_summary(_rows([100.0, 110.0, 120.0, 130.0]))  # step 1 (warm-up) ends at 100
    assert sync["time_to_steps_s"] == 30.0 and sync["samples_per_s"] == pytest.approx(48 / 30)
    assert sync["step_s"] == {"median": 10.0, "min": 10.0, "max": 10.0}
    assert sync["phases_s"] == {"time/train": 1.0}  # each timed phase's median (the warm-up step's left out)
    fast = run_summary(_rows([50.0, 53.0, 56.0, 60.0]))
    table = compare({"sync": [sync, sync], "fully_async": [fast, fast]})
    assert table["fully_async"]["speedup_vs_sync"] == pytest.approx(3.0)
    assert table["fully_async"]["speedup_per_repeat"] == pytest.approx([3.0, 3.0])
    assert table["sync"]["speedup_vs_sync"] == 1.0
    with pytest.raises(ValueError, match="at least 2 logged steps"):
        run_summary(_rows([1.0]))


def test_the_report_also_gives_the_speedup_without_the_checkpoint_saves() -> None:
    """A final save costs both modes the same seconds; on a short run it pulls the ratio toward 1."""
    sync_rows, fast_rows = _rows([100.0, 110.0, 120.0, 134.0]), _rows([50.0, 53.0, 56.0, 64.0])
    sync_rows[-1]["time/checkpoint"] = fast_rows[-1]["time/checkpoint"] = 4.0
    sync, fast = run_summary(sync_rows), run_summary(fast_rows)
    assert (sync["saves_s"], sync["time_to_steps_excluding_saves_s"]) == (4.0, 30.0)
    table = compare({"sync": [sync], "fully_async": [fast]})
    assert table["fully_async"]["speedup_vs_sync"] == pytest.approx(34 / 14)
    assert table["fully_async"]["speedup_excluding_saves_vs_sync"] == pytest.approx(3.0)


def test_the_report_sums_the_phases_and_says_what_no_phase_accounts_for() -> None:
    """Medians of phases do not add up to a step; their sums over the timed steps do, and the span
    minus the steps' phases (nested ones, like time/optimizer inside time/train, not counted twice)
    is the loop's own time."""
    rows = _rows([100.0, 110.0, 120.0, 134.0])  # timed steps of 10, 10 and 14 s; train 1 s each
    for row, wait in zip(rows[1:], (8.0, 2.0, 11.0), strict=True):
        row |= {"time/rollout": wait, "time/wait_batch": wait, "time/optimizer": 0.9, "time/sync": 0.5}
    summary = run_summary(rows)
    assert summary["phase_totals_s"]["time/rollout"] == 21.0 and summary["phase_totals_s"]["time/train"] == 3.0
    assert summary["unattributed_s"] == pytest.approx(34 - 21 - 3 - 1.5)
    assert summary["phases_s"]["time/rollout"] == 8.0  # the median step's wait, far from a third of the total
    rows[2] |= {"time/eval": 5.0, "eval/step": 2.0}  # fully_async's background evaluation: no phase of the step
    rows[3] |= {"time/eval": 1.0}  # sync's evaluation: one of its phases
    assert run_summary(rows)["unattributed_s"] == pytest.approx(34 - 21 - 3 - 1.5 - 1.0)


def test_the_report_compares_trained_response_lengths_with_sync_by_ks_distance(tmp_path) -> None:
    """The KS distance of two length samples (read from a run's step sample files, trained rows
    only) is the largest gap of their distribution functions; identical ones give 0, and the 5 %
    noise level shrinks with the sample sizes."""
    import json

    from miles_longtail.report import ks_distance, ks_noise, trained_lengths, trained_rows, turn_latencies

    samples = tmp_path / "run" / "samples"
    samples.mkdir(parents=True)
    turns = {"metadata": {"agent_result": {"model_seconds": [0.1, 0.3, 0.2]}}}
    rows = [{"response_tokens": 5, "batch_group": 0, **turns}, {"response_tokens": 9, "batch_group": 1},
            {"response_tokens": 40, "metadata": {"agent_result": {"model_seconds": [9.0]}}}]  # generated, never trained
    (samples / "step_000001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    trained = trained_rows(tmp_path / "run")
    assert trained_lengths(trained) == [5, 9]
    latency = turn_latencies(trained)  # the trained samples' turns only
    assert latency["median"] == pytest.approx(0.2) and latency["max"] == pytest.approx(0.3) and latency["turns"] == 3
    assert turn_latencies([{"batch_group": 0}]) == {}  # an agent that does not time its turns
    assert ks_distance([1, 2, 3, 4], [1, 2, 3, 4]) == 0.0
    assert ks_distance([1, 2, 3, 4], [3, 4, 5, 6]) == 0.5  # F_a(2)=0.5, F_b(2)=0
    assert ks_distance([1, 2], [10, 20]) == 1.0
    assert ks_noise(100, 100) == pytest.approx(0.192, abs=1e-3) and ks_noise(1000, 1000) < ks_noise(100, 100)
    sync = {**run_summary(_rows([100.0, 110.0, 120.0])), "trained_lengths": [1, 2, 3, 4]}
    late = {**run_summary(_rows([50.0, 53.0, 56.0])), "trained_lengths": [3, 4, 5, 6]}
    table = compare({"sync": [sync], "fully_async": [late]})
    assert table["fully_async"]["ks_length_vs_sync"] == 0.5 and table["sync"]["ks_length_vs_sync"] == 0.0
    assert table["fully_async"]["trained_length"] == {"median": 4.5, "min": 3, "max": 6}


def test_the_report_sums_what_the_engines_wrote_when_they_stopped(tmp_path) -> None:
    """Each life of each engine writes its statistics when it stops; the report sums them (a
    restarted engine's earlier life included) and derives the step and forward times."""
    import json

    from miles_engine.serve import STATS_PREFIX
    from miles_longtail.report import engine_stats

    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    assert engine_stats(tmp_path / "run") == {}  # no engine log
    life = {"decode_steps": 100, "decode_tokens": 3200, "decode_seconds": 0.5, "prefill_forwards": 40,
            "prefill_requests": 50, "prefill_seconds": 0.2, "finished": {"stop": 3}}
    (logs / "engine-0.log").write_text(f"==== start\nloading\n{STATS_PREFIX}{json.dumps(life)}\n==== start\n"
                                       f"{STATS_PREFIX}{json.dumps(life)}\n")
    (logs / "router.log").write_text(f"{STATS_PREFIX}{json.dumps(life)}\n")  # not an engine's
    (logs / "engine-1.log").write_text(f'{STATS_PREFIX}{{"decode_steps": 7\n')  # killed as it wrote: skipped
    stats = engine_stats(tmp_path / "run")
    assert (stats["decode_steps"], stats["prefill_forwards"]) == (200, 80)
    assert stats["mean_decode_batch"] == 32 and stats["decode_ms_per_step"] == pytest.approx(5.0)
    assert stats["prefill_ms_per_forward"] == pytest.approx(5.0)
