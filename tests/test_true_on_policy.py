"""`rollout.true_on_policy` end to end: `miles train` (sync, temperature 0.8) on the tiny dense
model for 5 steps, a reward that moves the weights every step (so steps 2 to 5 sample with freshly
synced weights), 6 concurrent samples prefilled together whose decode batch shrinks as they finish:
every trainable token's trainer log-prob equals the rollout's exactly (the metric is 0.0 and the
check, in `error` mode, counted no mismatch); on the CPU in fp32 and, marked `gpu`, on CUDA in bf16.
Then the tiny Qwen3-MoE (5 steps of multi-turn sessions, routing checked), multi-turn TITO sessions
trained with and without `train.reuse_rollout_logprobs` (exact on every token, the two runs equal
bit for bit), and the config errors, checked without starting anything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _train(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "miles.cli.main", "train", *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


def _start_train(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "miles.cli.main", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_true_on_policy_run_has_zero_diff_on_every_token(tiny_dense: Path, tmp_path: Path, vowel_reward: str,
                                                         device: str) -> None:
    """On the CPU in fp32 (PyTorch row loops); on CUDA in bf16 (the Triton kernels, CUDA-graph decode)."""
    out = _train(f"model.name={tiny_dense}", f"model.device={device}", f"run.output_dir={tmp_path}", "run.name=top",
                 "run.steps=5",
                 "run.dump_tokens=true", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=3",
                 "rollout.max_new_tokens=8", "rollout.temperature=0.8", "rollout.true_on_policy=true", "reward.name=remote",
                 f"reward.remote_url={vowel_reward}", "train.lr=1e-3", "data.options={digits: 1}")
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    run = tmp_path / "top"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    for m in metrics:
        assert m["train/train_rollout_logprob_abs_diff"] == 0.0
        assert m["train/train_rollout_logprob_abs_diff_max"] == 0.0
        assert m["train/true_on_policy_mismatched_tokens"] == 0.0
        assert m["train/true_on_policy_checked_tokens"] > 0
        assert m["train/grad_norm"] > 0  # the weights moved: steps 2 to 5 sample with updated weights
        assert m["train/skipped_steps"] == 0.0  # no step dropped for a non-finite gradient
    for step in (1, 2, 3, 4, 5):
        samples = [json.loads(line) for line in (run / "samples" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(samples) == 6
        assert {tuple(s["weight_versions"]) for s in samples} == {(step - 1,)}


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_true_on_policy_moe_run_is_exact_and_routes_like_the_engine(tiny_moe: Path, tmp_path: Path,
                                                                     vowel_reward: str, device: str) -> None:
    """The tiny Qwen3-MoE (invariant router and experts, ``miles_engine.invariant_moe``): 5 steps
    with a weight update after each, of multi-turn agentic sessions (the ``long_tail`` agent, 3 chat
    turns each through the session server: every later turn a prefill over the cached keys of the
    earlier ones), 4 sessions a step running concurrently with turns of random length, so the
    engine's decode batches and the rows' lengths vary, and the trainer runs micro-batches of
    different row counts (``train.micro_batch_tokens``). Every trainable token's log-prob is exact,
    and with routing capture on but replay off (``r3.replay: false``: the trainer routes by itself)
    the trainer's experts equal the engine's on every recorded (token, MoE layer) pair, which the run
    checks itself (a mismatch would fail the step: ``rollout.true_on_policy_check`` is ``error``)."""
    steps = 5
    out = _train(f"model.name={tiny_moe}", f"model.device={device}", f"run.output_dir={tmp_path}", "run.name=moe",
                 f"run.steps={steps}",
                 "run.dump_tokens=true", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
                 "rollout.max_new_tokens=6", "rollout.temperature=0.8", "rollout.true_on_policy=true",
                 "rollout.generator=agentic", "rollout.agent=long_tail", "tito.family=chatml", "longtail.turns=3",
                 "longtail.tokens_median=4", "longtail.tokens_max=6", "longtail.latency_scale=0.01",
                 "reward.name=remote", f"reward.remote_url={vowel_reward}", "train.lr=1e-2",
                 "train.micro_batch_tokens=320", "r3.enabled=true", "r3.replay=false", "data.options={digits: 1}")
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    run = tmp_path / "moe"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    for step, m in enumerate(metrics, start=1):
        samples = [json.loads(line) for line in (run / "samples" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(samples) == 4 and all(_sampled_turns(s["loss_mask"]) == 3 for s in samples)
        assert {v for s in samples for v in s["weight_versions"]} == {step - 1}  # every turn: the latest weights
        assert m["train/train_rollout_logprob_abs_diff"] == 0.0
        assert m["train/train_rollout_logprob_abs_diff_max"] == 0.0
        # every trainable token of every turn checked, none differing
        assert m["train/true_on_policy_checked_tokens"] == sum(sum(s["loss_mask"]) for s in samples)
        assert m["train/true_on_policy_mismatched_tokens"] == 0.0
        assert m["train/grad_norm"] > 0  # the weights moved: every later step samples with updated weights
        assert m["train/skipped_steps"] == 0.0  # no step dropped for a non-finite gradient
        # every recorded (token, MoE layer) pair checked by the run itself, none differing
        assert m["r3/train/replayed_tokens"] == sum(len(s["tokens"]) - 1 for s in samples)
        assert m["r3/train/true_on_policy_checked_pairs"] == 2 * m["r3/train/replayed_tokens"]  # 2 MoE layers
        assert m["r3/train/true_on_policy_mismatched_pairs"] == 0.0
        assert m["r3/train/routing_agreement"] == 1.0


def test_true_on_policy_config_errors_name_every_incompatible_key(tmp_path: Path) -> None:
    from miles.config import load_config

    with pytest.raises(Exception) as raised:
        load_config(None, ["rollout.true_on_policy=true", "rollout.engine=sglang", "train.backend=megatron",
                           "model.device=cpu", "model.dtype=bfloat16", "rollout.top_p=0.9", f"run.output_dir={tmp_path}"])
    message = str(raised.value)
    for key in ("rollout.engine", "train.backend", "model.dtype", "rollout.top_p"):
        assert key in message, message


@pytest.mark.slow
def test_reusing_the_rollout_logprobs_trains_bit_for_bit_like_recomputing_them(
        tiny_dense: Path, tmp_path: Path, vowel_reward: str) -> None:
    """Multi-turn TITO sessions (the long_tail agent: 3 chat turns through the session server, the
    model's turns trainable, the "tool results" between them not), two updates per step, so reuse off
    runs the old-policy pass over every token and its check finds them all exact; reuse on skips the
    pass. Same seed: every step's losses and gradient norms are equal, and step 2 samples the same
    tokens with the same log-probs (the weights after step 1 are equal bit for bit). The engine's
    radix cache is on: each later turn is prefilled over its cached history, and still every token
    is exact (``router/prefix_cache_*``: the step's cached share of the prompt tokens)."""
    started = {reuse: _start_train(
        f"model.name={tiny_dense}", f"run.output_dir={tmp_path}", f"run.name=reuse_{reuse}", "run.steps=2",
        "run.deterministic=true", "run.dump_tokens=true", "rollout.prompts_per_step=1", "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=6", "rollout.temperature=0.8", "rollout.true_on_policy=true",
        "rollout.generator=agentic", "rollout.agent=long_tail", "tito.family=chatml", "longtail.turns=3",
        "longtail.tokens_median=4", "longtail.tokens_max=6", "longtail.latency_scale=0.01", "reward.name=remote",
        f"reward.remote_url={vowel_reward}", "train.lr=1e-3", "train.updates_per_step=2",
        f"train.reuse_rollout_logprobs={reuse}", "data.options={digits: 1}",
        # the radix cache serves every later turn's history (it changes no bit under the switch);
        # the router's metrics middleware counts what it served: router/prefix_cache_hit_rate
        "engine.disable_radix_cache=false", "router.middlewares=[metrics]") for reuse in ("false", "true")}
    runs = {}
    try:
        for reuse, process in started.items():  # side by side: the runs share nothing but the reward server
            stdout, stderr = process.communicate(timeout=600)
            assert process.returncode == 0, stdout + stderr[-4000:]
            run = tmp_path / f"reuse_{reuse}"
            metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            samples = [[json.loads(line) for line in (run / "samples" / f"step_{s:06d}.jsonl").read_text().splitlines()]
                       for s in (1, 2)]
            runs[reuse] = metrics, samples
    finally:
        for process in started.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    (recomputed, recomputed_samples), (reused, reused_samples) = runs["false"], runs["true"]
    assert [m["step"] for m in reused] == [1, 2]
    for off, on, samples in zip(recomputed, reused, recomputed_samples, strict=True):
        assert all(_sampled_turns(s["loss_mask"]) == 3 for s in samples)
        # without reuse the old-policy pass is checked on every trainable token, all equal to the rollout's
        assert off["train/true_on_policy_checked_tokens"] == sum(sum(s["loss_mask"]) for s in samples)
        assert off["train/true_on_policy_mismatched_tokens"] == 0.0
        assert off["time/old_logprobs"] > 0 and "time/old_logprobs" not in on  # the pass ran only without reuse
        assert off["train/grad_norm"] > 0  # the weights moved: step 2 samples with updated weights
        losses = [k for k in off if k.startswith("train/") and "true_on_policy_checked" not in k]
        assert "train/pg_loss" in losses and "train/grad_norm" in losses
        assert {k: on[k] for k in losses} == {k: off[k] for k in losses}
        assert off["train/train_rollout_logprob_abs_diff"] == on["train/train_rollout_logprob_abs_diff"] == 0.0
        # the check still runs with reuse: on the first mini-batch's forward, before any update of the step
        assert on["train/true_on_policy_mismatched_tokens"] == 0.0
        assert 0 < on["train/true_on_policy_checked_tokens"] < off["train/true_on_policy_checked_tokens"]
        for m in (off, on):  # turns 2 and 3 of every session found their history in the engine's cache
            assert m["router/prefix_cache_prompt_tokens"] > m["router/prefix_cache_hit_tokens"] > 0
            assert 0 < m["router/prefix_cache_hit_rate"] < 1
    for off_step, on_step in zip(recomputed_samples, reused_samples, strict=True):
        assert [(s["tokens"], s["rollout_logprobs"]) for s in on_step] == \
               [(s["tokens"], s["rollout_logprobs"]) for s in off_step]


def test_reuse_rollout_logprobs_needs_true_on_policy_and_lifts_the_async_correction(tmp_path: Path) -> None:
    from miles.config import load_config
    from miles.errors import ConfigError

    with pytest.raises(ConfigError) as raised:  # every error at once, each naming its keys
        load_config(None, ["train.reuse_rollout_logprobs=true", "rollout.engine=sglang", "train.backend=megatron",
                           "rollout.max_new_tokens=9999", "rollout.max_context_len=100", f"run.output_dir={tmp_path}"])
    message = str(raised.value)
    assert "train.reuse_rollout_logprobs: true needs rollout.true_on_policy: true" in message, message
    assert "rollout.engine 'sglang'" in message and "train.backend 'megatron'" in message, message
    assert "rollout.max_new_tokens" in message, message
    # with it, true_on_policy's own errors name what cannot be exact
    with pytest.raises(ConfigError) as raised:
        load_config(None, ["train.reuse_rollout_logprobs=true", "rollout.true_on_policy=true", "rollout.engine=sglang",
                           f"run.output_dir={tmp_path}"])
    assert "rollout.true_on_policy needs rollout.engine: embedded" in str(raised.value)
    assert "reuse_rollout_logprobs" not in str(raised.value)
    # one_step_off without a correction: refused unless the rollout's log-probs are the old policy
    stale = ["run.mode=one_step_off", "algorithm.correction=none", "rollout.true_on_policy=true",
             f"run.output_dir={tmp_path}"]
    with pytest.raises(ConfigError, match="algorithm.correction is none"):
        load_config(None, stale)
    assert load_config(None, [*stale, "train.reuse_rollout_logprobs=true"]).train.reuse_rollout_logprobs


def _sampled_turns(loss_mask: list[int]) -> int:
    """How many runs of trainable (model-sampled) tokens a response holds."""
    return sum(1 for i, m in enumerate(loss_mask) if m and (i == 0 or not loss_mask[i - 1]))
