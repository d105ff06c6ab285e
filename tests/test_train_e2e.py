"""`miles train` end to end on CPU with a tiny random model: the real engine, router, FSDP backend
and weight transport as the local executor starts them. A tiny model answers garbage, which the
f1 reward scores 0; where a test needs the weights to move, or to hold a run at a known point, a
reward server on loopback (conftest's ``RewardGate``) scores the fraction of vowels in each answer
(deterministic, different within a group)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from miles_contracts.testing.processes import LoggedProcess, wait_ready

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from miles_models.testing import tiny_model

    return tiny_model("dense")


def _args(tiny_model: Path, out: Path, name: str, *extra: str) -> list[str]:
    return [
        f"model.name={tiny_model}", f"run.output_dir={out}", f"run.name={name}", "run.dump_tokens=true",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=12",
        "rollout.filters=[no_aborted]", "reward.name=f1", "data.options={digits: 1}", *extra,
    ]


def _train(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "miles.cli.main", "train", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _samples(run: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (run / "samples" / f"step_{step:06d}.jsonl").read_text().splitlines()]


class BackgroundRun:
    """A `miles train` started in the background (the tests that read it run their own runs
    meanwhile); :meth:`finished` waits for it and hands back its folder and output."""

    def __init__(self, out: Path, name: str, *args: str) -> None:
        self.run = out / name
        self.process = LoggedProcess([sys.executable, "-m", "miles.cli.main", "train", *args], out / f"{name}.out",
                                     cwd=ROOT, env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}).start()

    def finished(self) -> tuple[Path, str]:
        """The run's folder and output, once it has exited with status 0 (``LoggedProcess.finished``)."""
        return self.run, self.process.finished(f"the background run {self.run.name} to finish")


@pytest.fixture(scope="module")
def checked_runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, BackgroundRun]]:
    """Two 2-step runs in check mode, started together: a plain one ("ci") and one that releases the
    engine's memory while the trainer trains ("released"), each read by its own test."""
    out = tmp_path_factory.mktemp("checked")
    runs: dict[str, BackgroundRun] = {}
    try:
        runs["ci"] = BackgroundRun(out, "ci", *_args(tiny_model, out, "ci", "run.steps=2", "weights.check=true"))
        runs["released"] = BackgroundRun(out, "released", *_args(
            tiny_model, out, "released", "run.steps=2", "weights.check=true", "eval.every=1", "eval.num_prompts=2",
            "resources.release_engine_memory=all"))
        yield runs
    finally:
        for run in runs.values():
            run.process.stop()


@pytest.mark.slow
def test_two_steps_train_sync_and_checkpoint(checked_runs: dict[str, BackgroundRun]) -> None:
    run, output = checked_runs["ci"].finished()
    metrics = _metrics(run)
    # check mode: every sync was compared on the engine, and the run says so
    assert [(m["weights/check_passed"], m["weights/checked_engines"]) for m in metrics] == [(1.0, 1.0)] * 2
    for version in (0, 1, 2):  # version 0: the start-up sync that replaces the engine's noise
        assert f"weights check passed: version {version} is bit-exact on 1 engine(s)" in output, output[-3000:]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["rollout/samples"] == 8 and m["rollout/groups_kept"] == 2
        assert 0.0 <= m["rollout/reward_mean"] <= 1.0
        assert m["reward/scored"] == 8
        # fp32 engine vs fp32 trainer on the same weights: log-probs agree to rounding error
        assert m["train/train_rollout_logprob_abs_diff"] < 1e-3
        assert m["train/optimizer_steps"] >= 1
    assert [m["weights/version"] for m in metrics] == [1.0, 2.0]
    for step in (1, 2):
        for s in _samples(run, step):
            n = s["response_tokens"]
            assert len(s["loss_mask"]) == n == len(s["rollout_logprobs"]) and n > 0
            assert set(s["loss_mask"]) == {1}  # single turn: every response token was sampled
            assert len(s["tokens"]) > n
            # samples of step 2 were generated by the weights pushed after step 1
            assert s["weight_versions"] == [step - 1]
    checkpoint = run / "checkpoints" / "step_000002"
    assert (checkpoint / "miles-state.json").is_file()
    assert json.loads((checkpoint / "miles-state.json").read_text())["step"] == 2
    assert "step 2/2 | reward" in output
    assert "run completed" in output
    # no config file: the run said what it is before its first step (here: which overrides leave the
    # measured expectation of the embedded default behind), and how the reward moved after its last
    lines = output.splitlines()
    intro = next(i for i, line in enumerate(lines) if line.startswith("no config file: the embedded default"))
    assert lines[intro].startswith("no config file: the embedded default with model.name, data.options, "
                                   "rollout.prompts_per_step, rollout.max_new_tokens, reward.name, run.steps changed")
    assert intro < next(i for i, line in enumerate(lines) if line.startswith("step 1/2 |"))
    trend = f"rollout reward (mean): step 1 {metrics[0]['rollout/reward_mean']:.3f} -> step 2 " \
            f"{metrics[1]['rollout/reward_mean']:.3f}"
    assert lines.index(trend) > next(i for i, line in enumerate(lines) if line.startswith("step 2/2 |"))


def _without_timings(record: dict) -> dict:
    return {k: v for k, v in record.items() if not (k.startswith("time") or "per_s" in k or k.endswith("/seconds"))}


def _seeded(vowel_reward: str) -> tuple[str, ...]:
    """A deterministic run whose rewards move the weights every step, trained on flat rows (the
    reference of the prefix-tree test below; "auto" may pick a tree for a group)."""
    return ("run.deterministic=true", "reward.name=remote", f"reward.remote_url={vowel_reward}", "fsdp.prefix_tree=off")


@pytest.fixture(scope="module")
def straight(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, vowel_reward: str) -> Iterator[BackgroundRun]:
    """One straight deterministic 3-step run without a final save, read by two tests (the rerun and
    resume test reproduces all of it, the prefix-tree test its step 1)."""
    out = tmp_path_factory.mktemp("straight")
    run = BackgroundRun(out, "straight", *_args(tiny_model, out, "straight", "run.steps=3", "run.save_final=false",
                                                *_seeded(vowel_reward)))
    yield run
    run.process.stop()


@pytest.mark.slow
def test_a_deterministic_run_is_reproduced_by_a_rerun_and_by_a_resume(
        tiny_model: Path, tmp_path: Path, vowel_reward: str, straight: BackgroundRun) -> None:
    """run.deterministic: a second run, stopped after step 2 and resumed, logs exactly the metrics
    of a straight 3-step run (fp32 CPU engine, same thread count), with rewards that move the
    weights every step. Along the way: the final save can be switched off, and keep_checkpoints
    leaves one checkpoint of several saves."""
    seeded = _seeded(vowel_reward)
    first = _train(*_args(tiny_model, tmp_path, "resumed", "run.steps=2", "run.save_every=1", *seeded))
    assert first.returncode == 0, first.stderr
    assert [p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir()] == ["step_000002"]  # step 1 pruned
    # as if the first run had logged step 3 and crashed before its checkpoint
    with (tmp_path / "resumed" / "metrics.jsonl").open("a") as metrics:
        metrics.write('{"step": 3, "time": 0.0, "rollout/reward_mean": -1.0}\n')
    resumed = _train("--resume", str(tmp_path / "resumed"), "run.steps=3")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stderr
    straight_run, output = straight.finished()
    assert not (straight_run / "checkpoints").exists()
    assert "no checkpoints will be written" in output
    assert [m["step"] for m in _metrics(tmp_path / "resumed")] == [1, 2, 3]
    assert _metrics(tmp_path / "resumed")[-1]["time"] > 0  # step 3's record is the resumed run's
    assert '"rollout/reward_mean": -1.0' in (tmp_path / "resumed" / "metrics.superseded.jsonl").read_text()
    prompts = lambda run: [s["prompt"] for s in _samples(run, 3)]  # noqa: E731
    assert prompts(tmp_path / "resumed") == prompts(straight_run)
    # the engines were brought to the checkpoint's weights before generating step 3
    assert {tuple(s["weight_versions"]) for s in _samples(tmp_path / "resumed", 3)} == {(2,)}
    # every metric but timings, bit for bit: losses, gradient norms, rollout-vs-train log-prob gaps
    expected = [_without_timings(m) for m in _metrics(straight_run)]
    assert [_without_timings(m) for m in _metrics(tmp_path / "resumed")] == expected
    assert all(m["train/grad_norm"] > 0 for m in expected) and len(expected[0]) > 30
    tokens = lambda run: [[s["tokens"] for s in _samples(run, step)] for step in (1, 2, 3)]  # noqa: E731
    assert tokens(tmp_path / "resumed") == tokens(straight_run)


@pytest.mark.slow
def test_one_step_off_resumes_with_the_prompts_the_interrupted_step_had(tiny_model: Path, tmp_path: Path) -> None:
    """In one_step_off the next step's rollout draws its prompts while this step trains; a
    checkpoint keeps the data position from before that draw, so a resume generates the same
    prompts for that step (it used to skip them and draw the following ones)."""
    run = tmp_path / "overlap"
    first = _train(*_args(tiny_model, tmp_path, "overlap", "run.mode=one_step_off", "algorithm.correction=tis",
                          "run.steps=3", "run.save_every=1", "run.keep_checkpoints=3"))
    assert first.returncode == 0, first.stderr
    prompts = [s["prompt"] for s in _samples(run, 3)]
    shutil.rmtree(run / "checkpoints" / "step_000003")  # as if it had crashed before step 3's checkpoint
    resumed = _train("--resume", str(run))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stderr and "(step 2, weight version" in resumed.stderr
    assert [s["prompt"] for s in _samples(run, 3)] == prompts


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def _start_train(log: Path, *args: str, **options) -> LoggedProcess:
    """`miles train` in the background, its output in ``log``."""
    return LoggedProcess([sys.executable, "-m", "miles.cli.main", "train", *args], log, cwd=ROOT,
                         env={"OMP_NUM_THREADS": "1"}, **options).start()


def _first_step_logged(run: Path) -> bool:
    path = run / "metrics.jsonl"
    return path.exists() and bool(path.read_text().strip())


@pytest.mark.slow
def test_ctrl_c_leaves_no_processes(tiny_model: Path, tmp_path: Path) -> None:
    # a suite started in the background (`cmd &` without job control) passes SIGINT on ignored, and
    # an ignored Ctrl-C is what such a user asked for
    proc = _start_train(tmp_path / "interrupted.out", *_args(tiny_model, tmp_path, "interrupted", "run.steps=50"),
                        default_signals=[signal.SIGINT])
    manifest = tmp_path / "interrupted" / "services.json"
    try:
        proc.wait_ready(manifest.exists, f"the run's services listed in {manifest}")
        pids = [row["pid"] for row in json.loads(manifest.read_text())]
        assert len(pids) == 3  # the trainer rank, the engine and the router
        proc.wait_ready(lambda: _first_step_logged(tmp_path / "interrupted"), "the run's first step")  # mid-run
        proc.send_signal(signal.SIGINT)
        proc.wait_exit("the run to stop after Ctrl-C")
    finally:
        proc.stop()
    output = proc.output()
    assert proc.returncode != 0
    assert "run interrupted" in output
    wait_ready(lambda: not _pids_alive(pids), f"the run's processes {pids} to end (no orphans)", deadline_s=120)


def _kill_the_engine_while_held(proc: LoggedProcess, run: Path, gate) -> tuple[dict, str]:
    """SIGKILL the run's engine while ``gate`` holds a scoring request, let the run go on; the
    engine's manifest row from before and the run's output."""
    try:
        proc.wait_ready(gate.reached.is_set, f"scoring request #{gate.hold} held at the reward server")
        engine = next(r for r in json.loads((run / "services.json").read_text()) if r["name"] == "engine-0")
        os.kill(engine["pid"], signal.SIGKILL)
        gate.released.set()
        proc.wait_exit("the run to finish after the engine was killed")
    finally:
        proc.stop()
    return engine, proc.output()


@pytest.mark.slow
def test_engine_killed_mid_run_is_restarted_and_the_run_finishes(tiny_model: Path, tmp_path: Path, reward_gate) -> None:
    """The engine is killed while step 2's scoring is held (after its generation, before its
    weight sync): the sync finds it gone, waits for the supervisor's restart and pushes again."""
    run = tmp_path / "crash"
    proc = _start_train(tmp_path / "crash.out", *_args(tiny_model, tmp_path, "crash", "run.steps=4",
                                                       "rollout.max_new_tokens=48", "reward.name=remote",
                                                       f"reward.remote_url={reward_gate.url}"))
    engine, output = _kill_the_engine_while_held(proc, run, reward_gate)
    assert proc.returncode == 0, output
    restarted = next(r for r in json.loads((run / "services.json").read_text()) if r["name"] == "engine-0")
    assert restarted["restarts"] == 1 and restarted["pid"] != engine["pid"]
    metrics = _metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["weights/engines_restarted"] for m in metrics] == [0.0, 1.0, 0.0, 0.0]
    # every sample of the run ended as an answer or an abort with a reason
    for step in (1, 2, 3, 4):
        for s in _samples(run, step):
            assert s["status"] in {"completed", "truncated", "aborted"}
            if s["status"] == "aborted":
                assert s["exit_detail"]


@pytest.mark.slow
def test_an_engine_lost_between_steps_gets_the_weights_before_it_serves_again(tiny_model: Path, tmp_path: Path,
                                                                             reward_gate) -> None:
    """The engine is killed after step 1's weight sync (while step 1's evaluation is scored). It
    comes back with the base model, which the router holds back (behind the fleet's version):
    step 2 pushes it the trainer's weights before generating, so every sample step 2 trains on was
    generated by version 1, and the run does not wait for a router that has nothing to serve."""
    run = tmp_path / "idle"
    proc = _start_train(tmp_path / "idle.out", *_args(tiny_model, tmp_path, "idle", "run.steps=2", "eval.every=1",
                                                      "eval.num_prompts=2", "reward.name=remote",
                                                      f"reward.remote_url={reward_gate.url}"))
    _, output = _kill_the_engine_while_held(proc, run, reward_gate)  # held: step 1's evaluation, after its sync
    assert proc.returncode == 0, output
    step1, step2 = _metrics(run)
    assert step1["weights/version"] == 1.0 and step2.get("weights/resynced_engines") == 1.0, step2
    trained = [s for s in _samples(run, 2) if s["status"] != "aborted"]
    assert trained and all(s["weight_versions"] == [1] for s in trained)


@pytest.mark.slow
def test_one_step_off_on_two_ranks_and_a_killed_rank_stops_the_run(tiny_model: Path, tmp_path: Path) -> None:
    """Two FSDP rank processes train in one_step_off mode; killing one mid-run fails the run at
    once, naming the rank and the checkpoint to resume from, and leaves no process behind."""
    run = tmp_path / "ranks"
    proc = _start_train(tmp_path / "ranks.out", *_args(tiny_model, tmp_path, "ranks", "run.steps=50", "run.save_every=1",
                                                       "run.mode=one_step_off", "algorithm.correction=tis",
                                                       "resources.trainer_ranks=2"))
    try:
        proc.wait_ready(lambda: (run / "metrics.jsonl").exists() and len(_metrics(run)) >= 2, "two steps logged")
        rows = {row["name"]: row for row in json.loads((run / "services.json").read_text())}
        assert {"trainer-0", "trainer-1", "engine-0", "router"} <= set(rows)
        os.kill(rows["trainer-1"]["pid"], signal.SIGKILL)
        proc.wait_exit("the run to stop after the loss of a rank")
    finally:
        proc.stop()
    output = proc.output()
    first, second = _metrics(run)[:2]
    assert first["train/optimizer_steps"] == 1 and second["train/optimizer_steps"] == 2  # trained on the ranks
    # one_step_off: step 1's weights go out once step 2's rollout (made with version 0) is done
    assert "weights/version" not in first and second["weights/version"] == 1.0
    assert proc.returncode != 0
    assert "trainer rank 1 (trainer-1) died" in output and "SIGKILL" in output, output[-3000:]
    assert "the last checkpoint is" in output and f"miles train --resume {run}" in output
    pids = [row["pid"] for row in rows.values()]
    wait_ready(lambda: not _pids_alive(pids), f"the run's processes {pids} to end", deadline_s=120)


@pytest.mark.slow
def test_engines_release_their_memory_while_the_trainer_trains(checked_runs: dict[str, BackgroundRun]) -> None:
    """resources.release_engine_memory=all (run.mode sync): after each rollout the engine gives
    back its KV cache and weights (on the CPU its weights stay where they are, but the engine
    refuses updates to them until they are resumed), takes the weights back before the sync and
    the rest right after it. In check mode every sync is bit-exact, evaluation and the next
    rollout run on the synced weights, and both phases are timed."""
    run, output = checked_runs["released"].finished()
    metrics = _metrics(run)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["time/release"] > 0 and m["time/resume"] > 0
        assert m["weights/check_passed"] == 1.0 and m["eval/num_prompts"] == 2.0
    assert "weights check passed: version 2 is bit-exact on 1 engine(s)" in output
    assert {tuple(s["weight_versions"]) for s in _samples(run, 2)} == {(1,)}
    assert {tuple(s["weight_versions"]) for s in _samples_of(run, "eval", 2)} == {(2,)}


def _samples_of(run: Path, kind: str, step: int) -> list[dict]:
    return [json.loads(line) for line in (run / kind / f"step_{step:06d}.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_an_engine_that_restarted_while_released_gets_the_weights_and_no_resume(tiny_model: Path, tmp_path: Path,
                                                                               reward_gate) -> None:
    """The engine is killed while step 2's scoring is held, just before its release: the release
    finds it gone or already restarted, the restarted process is not asked to resume what it never
    released, and the sync gives it the trainer's weights (bit-exact in check mode)."""
    run = tmp_path / "restarted"
    proc = _start_train(tmp_path / "restarted.out", *_args(tiny_model, tmp_path, "restarted", "run.steps=3",
                                                           "weights.check=true", "resources.release_engine_memory=all",
                                                           "reward.name=remote", f"reward.remote_url={reward_gate.url}"))
    _, output = _kill_the_engine_while_held(proc, run, reward_gate)
    assert proc.returncode == 0, output
    metrics = _metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["weights/engines_restarted"] for m in metrics] == [0.0, 1.0, 0.0]
    assert all(m["weights/check_passed"] == 1.0 and "time/release" in m and "time/resume" in m for m in metrics)
    assert {tuple(s["weight_versions"]) for s in _samples(run, 3)} == {(2,)}


@pytest.mark.slow
def test_prefix_tree_training_logs_the_loss_of_flat_rows(tiny_model: Path, tmp_path: Path, vowel_reward: str,
                                                         straight: BackgroundRun) -> None:
    """fsdp.prefix_tree: on (each group's 4 samples share their prompt: one tree per micro-batch)
    trains the same step as off: the same samples (deterministic engine), the same loss and gradient.
    The "off" side is step 1 of the straight run above (prefix_tree=off, the same settings, and a
    deterministic run's step 1 does not depend on how many steps follow: the resume test holds it
    to a rerun bit for bit)."""
    seeded = [arg for arg in _seeded(vowel_reward) if not arg.startswith("fsdp.prefix_tree=")]
    out = _train(*_args(tiny_model, tmp_path, "tree-on", *seeded, "run.steps=1", "run.save_final=false",
                        "fsdp.prefix_tree=on"))
    assert out.returncode == 0, out.stdout + out.stderr
    straight_run, _ = straight.finished()
    runs = {"on": _metrics(tmp_path / "tree-on")[0], "off": _metrics(straight_run)[0]}
    assert runs["off"]["step"] == 1
    assert [s["tokens"] for s in _samples(tmp_path / "tree-on", 1)] == [s["tokens"] for s in _samples(straight_run, 1)]
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/entropy"):
        assert runs["on"][key] == pytest.approx(runs["off"][key], rel=1e-5, abs=1e-7), key
    assert runs["off"]["train/grad_norm"] > 0
