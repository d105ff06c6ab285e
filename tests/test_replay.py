"""``miles replay``: a step of a real tiny ``miles train`` run (CPU, embedded engine, FSDP backend)
trained again from the run folder's dumps, with the same loss and the same weights after the update
bit for bit; a tampered dump is caught; ``--rescore`` scores the recorded episodes with another
reward. The rewards move the weights: conftest's ``vowel_reward`` scores each answer's fraction of
vowels (a reward server on loopback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _miles(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}  # the run's thread count: same bits
    return subprocess.run([sys.executable, "-m", "miles.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory, vowel_reward: str) -> Path:
    """Two steps, a checkpoint after each (both kept), token dumps and weight digests."""
    out = tmp_path_factory.mktemp("replay")
    done = _miles("train", f"model.name={tiny_dense}", f"run.output_dir={out}", "run.name=r", "run.steps=2",
                  "run.dump_tokens=true", "run.weights_digest=true", "run.save_every=1", "run.keep_checkpoints=2",
                  "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=12",
                  "reward.name=remote", f"reward.remote_url={vowel_reward}", "data.options={digits: 1}")
    assert done.returncode == 0, done.stderr[-3000:]
    return out / "r"


@pytest.mark.slow
def test_replay_of_a_step_gives_the_runs_loss_and_weights_bit_for_bit(run: Path) -> None:
    replayed = _miles("replay", str(run), "--step", "2")
    assert replayed.returncode == 0, replayed.stdout[-3000:] + replayed.stderr[-3000:]
    report = json.loads(replayed.stdout)
    logged = _lines(run / "metrics.jsonl")[1]
    assert report["started_from"] == str(run / "checkpoints" / "step_000001")  # the weights before step 2
    assert report["replayed_steps"] == [2]
    assert report["equal"] and report["differ"] == {} and report["compared_metrics"] > 15
    assert report["loss"] == logged["train/loss"] and logged["train/grad_norm"] > 0  # the weights moved
    assert report["metrics"]["train/grad_norm"] == logged["train/grad_norm"]
    assert report["weights_digest"] == report["recorded_weights_digest"] == logged["train/weights_digest"]
    assert _lines(run / "metrics.jsonl")[0]["train/weights_digest"] != logged["train/weights_digest"]


@pytest.mark.slow
def test_replay_from_the_base_model_names_the_first_step_a_changed_dump_breaks(run: Path, tmp_path: Path) -> None:
    """Without a checkpoint before step 2 the replay trains step 1 again first, from the base model;
    a reward changed in step 1's dump changes its update, and the replay says so (exit code 1)."""
    import shutil

    copy = tmp_path / "r"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("step_000002"))  # step 2's checkpoint (not its dump)
    shutil.copy(run / "samples" / "step_000002.jsonl", copy / "samples")
    shutil.rmtree(copy / "checkpoints" / "step_000001")
    dump = copy / "samples" / "step_000001.jsonl"
    lines = _lines(dump)
    lines[0]["reward"] = 1.0  # one sample's reward: the group's advantages and the update change
    dump.write_text("".join(json.dumps(line) + "\n" for line in lines))
    replayed = _miles("replay", str(copy), "--step", "2")
    assert replayed.returncode == 1, replayed.stdout[-3000:] + replayed.stderr[-3000:]
    report = json.loads(replayed.stdout)
    assert report["started_from"] == "the base model" and report["replayed_steps"] == [1, 2]
    assert report["first_step_that_differs"] == 1 and not report["equal"]
    assert "train/weights_digest" in report["earlier_steps"][0]["differ"]


def test_rescore_scores_the_recorded_episodes_with_another_reward(run: Path) -> None:
    from miles.rewards.exact_match import exact_match_score

    rescored = _miles("replay", str(run), "--step", "1", "--rescore", "--reward", "exact_match")
    assert rescored.returncode == 0, rescored.stderr[-3000:]
    report = json.loads(rescored.stdout)
    dumped = _lines(run / "samples" / "step_000001.jsonl")
    assert [(r["index"], r["old"]) for r in report["samples"]] == [(d["index"], d["reward"]) for d in dumped]
    assert [r["new"] for r in report["samples"]] == [exact_match_score(d["response"], d["label"]) for d in dumped]
    assert {r["reward"] for r in report["samples"]} == {"exact_match"}
    summary = report["summary"]
    assert summary["samples"] == summary["scored"] == 8 and summary["failed"] == 0
    assert summary["changed"] == sum(d["reward"] != exact_match_score(d["response"], d["label"]) for d in dumped) > 0
    assert summary["old_mean"] == pytest.approx(sum(d["reward"] for d in dumped) / 8)
    # the run folder is read, never written
    assert _lines(run / "samples" / "step_000001.jsonl") == dumped


def test_replay_refuses_what_it_cannot_replay(run: Path, tmp_path: Path) -> None:
    absent = _miles("replay", str(run), "--step", "7")
    assert absent.returncode == 2 and "no dump of step 7 (it has steps 1..2)" in absent.stderr
    changed = _miles("replay", str(run), "train.lr=1", "--step", "2")
    assert changed.returncode == 2 and "a replay trains with the run's own config" in changed.stderr
    (tmp_path / "config.yaml").write_text((run / "config.yaml").read_text().replace("dump_tokens: true",
                                                                                    "dump_tokens: false"))
    (tmp_path / "samples").mkdir()
    dump = _lines(run / "samples" / "step_000001.jsonl")
    (tmp_path / "samples" / "step_000001.jsonl").write_text(
        "".join(json.dumps({k: v for k, v in d.items() if k not in ("tokens", "loss_mask")}) + "\n" for d in dump))
    no_tokens = _miles("replay", str(tmp_path), "--step", "1")
    assert no_tokens.returncode == 2 and "run.dump_tokens=true" in no_tokens.stderr
