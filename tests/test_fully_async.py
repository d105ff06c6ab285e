"""Partial rollout and fully_async mode with the tiny model: the real engine and router (started by
the local executor, as a run starts them), the real FSDP backend and shared-memory weight transport."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from miles_contracts.testing.processes import LoggedProcess

ROOT = Path(__file__).resolve().parents[1]
LONG = 200  # tokens of the generation that spans the update


class RecordingEngine:
    """The run's real engine client, keeping each request and answer so the test can look at them."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.base_url = client.base_url
        self.calls: list[tuple[Any, Any]] = []

    async def generate(self, request: Any, *, routing_key: str | None = None) -> Any:
        response = await self.client.generate(request, routing_key=routing_key)
        self.calls.append((request, response))
        return response


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from miles_models.testing import tiny_model

    return tiny_model("dense")


def _config(tiny_model: Path) -> Any:
    from miles.config import MilesConfig
    from miles.sections import (
        AlgorithmSection,
        ModelSection,
        RolloutSection,
        RunSection,
        TrainSection,
        WeightsSection,
    )
    from miles_fsdp.config import FSDPSection

    return MilesConfig(
        model=ModelSection(name=str(tiny_model), device="cpu"),
        run=RunSection(mode="fully_async"),
        rollout=RolloutSection(max_new_tokens=8, samples_per_prompt=2),
        train=TrainSection(lr=0.05),
        weights=WeightsSection(transport="shared_memory"),
        algorithm=AlgorithmSection(correction="tis", correction_high=1e6),
        extra={"fsdp": FSDPSection()},
    )


def test_a_trajectory_spanning_a_weight_update_keeps_its_first_tokens_records_two_versions_and_trains(
    tiny_model: Path, tmp_path: Path
) -> None:
    import torch
    from miles.builtin.generators import single_turn
    from miles.context import context_for
    from miles.engine_client import HttpEngineClient
    from miles.executor.local import LocalExecutor
    from miles.loop.learner import Learner
    from miles.loop.runner import place
    from miles.loop.services import start_services
    from miles_contracts import GenerateContext, Process, Sample, TrainBatch
    from miles_contracts.wire.engine import SamplingParams
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    config = _config(tiny_model)
    (tmp_path / "config.yaml").write_text(config.to_yaml())  # what the services read, as in a run
    ctx = context_for(config, Process.driver(), run_dir=tmp_path, configure=True)
    kernel = ctx.kernel
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    # this process plays the driver and the one trainer rank
    rank = context_for(config, Process.trainer_rank(0), run_dir=tmp_path, kernel=kernel)
    backend = kernel.train_backends().get("fsdp").create(rank)
    transport = kernel.weight_transports().get("shared_memory").create(rank)
    learner = Learner(config, kernel, backend, tokenizer.pad_token_id)
    executor = LocalExecutor(tmp_path, startup_timeout=config.executor.startup_timeout)
    try:
        services = start_services(config, kernel, tiny_model, executor, place(config, executor, kernel), tmp_path)
        services.wait_ready(config.executor.startup_timeout)
        engine = RecordingEngine(HttpEngineClient(services.router_url))
        engine_url = next(iter(services.engine_urls.values()))

        def context(max_new_tokens: int) -> GenerateContext:
            params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
            return GenerateContext(engine=engine, tokenizer=tokenizer, sampling_params=params, max_context_len=1024,
                                   run=ctx, partial_rollout=True)

        async def scenario() -> tuple[list[Sample], Sample]:
            # version 0 rollouts, one training step: the trainer's weights are no longer the engine's
            warmup = [Sample(prompt=f"{i} + {i} =", group_index=0, index=i) for i in range(2)]
            await asyncio.gather(*(single_turn(s, context(8)) for s in warmup))
            for s, reward in zip(warmup, (1.0, 0.0), strict=True):
                s.reward = reward
            await asyncio.to_thread(learner.train, warmup)
            # a long generation under version 0; once it is well under way, push the new weights as version 1
            long = Sample(prompt="7 + 8 =", group_index=1, index=2)
            task = asyncio.create_task(single_turn(long, context(LONG)))
            await _until_decoding(engine_url, steps=8)
            await asyncio.to_thread(transport.push, backend.named_weights(), targets=[engine_url], version=1)
            await task
            return warmup, long

        warmup, long = asyncio.run(scenario())
    finally:
        transport.close()
        executor.shutdown()

    first, second = engine.calls[-2], engine.calls[-1]
    assert first[1].meta_info.finish_reason.type == "abort"  # the update paused the engine mid-generation
    kept = list(first[1].output_ids)
    assert 0 < len(kept) < LONG
    assert second[0].input_ids == first[0].input_ids + kept  # it went on from the tokens it had
    assert second[0].sampling_params.max_new_tokens == LONG - len(kept)
    assert long.response_tokens[: len(kept)] == kept and long.response_length == LONG
    assert long.weight_versions == [0, 1]
    assert long.token_versions == [0] * len(kept) + [1] * (LONG - len(kept))
    assert long.rollout_logprobs[: len(kept)] == first[1].logprobs()
    long.validate()

    # the second part was sampled by the new weights: the trainer (which holds them) agrees with
    # its log-probs; the first part's came from the weights before the update
    long.reward, other = 1.0, warmup[0]
    batch = TrainBatch.from_samples([long], tokenizer.pad_token_id)
    trainer = backend.compute_logprobs(batch)[0, long.prompt_length:]
    rollout = torch.tensor(long.rollout_logprobs)
    before, after = (trainer - rollout)[: len(kept)].abs().mean(), (trainer - rollout)[len(kept):].abs().mean()
    assert after < 1e-3 < before
    # the correction reads each token's own behaviour log-prob: weight 1 where the trainer sampled
    # the token itself (version 1), pi_trainer / pi_version_0 on the first part
    from miles_algorithms.corrections import truncated_importance_sampling

    proximal = backend.compute_logprobs(batch)
    weights, _ = truncated_importance_sampling(proximal, batch.rollout_logprobs, batch.loss_mask, config.algorithm)
    weights = weights[0, long.prompt_length:]
    expected = (trainer - rollout).exp()
    assert torch.allclose(weights, expected, rtol=1e-4)
    assert (weights[len(kept):] - 1).abs().max() < 1e-2 < (weights[: len(kept)] - 1).abs().mean()

    metrics = learner.train([long, other])  # trains, with the TIS correction over the off-policy part
    assert batch.token_versions[0, long.prompt_length:].tolist() == long.token_versions
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert metrics["train/samples"] == 2 and "train/correction_weight" in metrics


async def _until_decoding(engine_url: str, steps: int, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    from miles_contracts.wire.auth import auth_headers

    async with httpx.AsyncClient(base_url=engine_url, headers=auth_headers()) as http:
        start = (await http.get("/get_server_info")).json()["stats"]["decode_steps"]
        while time.monotonic() < deadline:
            if (await http.get("/get_server_info")).json()["stats"]["decode_steps"] >= start + steps:
                return
            await asyncio.sleep(0.01)
    raise TimeoutError(f"the engine did not decode {steps} steps in {timeout} s")


def test_fully_async_run_trains_from_the_buffer_and_evaluates_in_the_background(tiny_model: Path, tmp_path: Path) -> None:
    """`miles train` in fully_async mode on the agentic path: the long_tail agent (miles-longtail) plays
    short episodes through the run's session server, which continues turns a weight update aborts."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    args = [
        f"model.name={tiny_model}", f"run.output_dir={tmp_path}", "run.name=async", "run.dump_tokens=true",
        "run.mode=fully_async", "run.steps=3", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
        "rollout.concurrency=8", "rollout.max_staleness=1", "rollout.filters=[no_aborted]", "algorithm.correction=tis",
        "rollout.generator=agentic", "rollout.agent=long_tail", "tito.family=chatml", "rollout.max_new_tokens=16",
        "longtail.turns=2", "longtail.tokens_median=6", "longtail.tokens_max=16", "longtail.latency_scale=0.01",
        "reward.name=repeated_tokens", "data.options={digits: 1}", "eval.every=2", "eval.num_prompts=2",
    ]
    out = subprocess.run([sys.executable, "-m", "miles.cli.main", "train", *args], capture_output=True, text=True,
                         timeout=600, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    run = tmp_path / "async"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["weights/version"] for m in metrics] == [1.0, 2.0, 3.0]
    for m in metrics:
        assert m["rollout/groups_kept"] == 2 and m["train/samples"] == 4
        assert m["async/staleness_max"] <= 1  # the bound held when each batch was taken
    assert any("eval/accuracy" in m for m in metrics) and metrics[-1]["eval/step"] == 3.0
    for step in (1, 2, 3):
        rows = [json.loads(line) for line in (run / "samples" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        for row in rows:
            n = row["response_tokens"]
            assert len(row["token_versions"]) == n == len(row["loss_mask"])
            # sampled tokens carry the version that sampled them, the tool results between turns -1
            assert all((v >= 0) == bool(m) for v, m in zip(row["token_versions"], row["loss_mask"], strict=True))
            assert max(row["token_versions"]) <= step - 1  # sampled by weights pushed before this step


@pytest.mark.slow
def test_an_engine_restarted_while_step_2s_groups_are_held_leaves_nothing_late_and_the_run_finishes(
        tiny_model: Path, tmp_path: Path, reward_gate) -> None:
    """From the third scoring request on every one is held (step 2's groups, which the workers
    start only after step 1's push at max_staleness 0); the engine is killed and restarted with
    the base model meanwhile. Released, the held groups are not late (none is thrown away or
    regenerated, as the old gate made them), and the run finishes with the restarted engine.
    The watcher that pushes weights to a restarted engine while the trainer waits
    (_resync_restarted_engines) is no longer forced by this scenario: with the corrected launch
    pacing no group needs the restarted engine before step 2's push."""
    run = tmp_path / "lost"
    args = [
        f"model.name={tiny_model}", f"run.output_dir={tmp_path}", "run.name=lost", "run.mode=fully_async",
        "run.steps=2", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_staleness=0",
        "rollout.max_new_tokens=8", "algorithm.correction=tis", "reward.name=remote",
        f"reward.remote_url={reward_gate.url}", "data.options={digits: 1}",
    ]
    reward_gate.hold, reward_gate.and_after = 3, True  # step 1's batch is the first two groups scored
    proc = LoggedProcess([sys.executable, "-m", "miles.cli.main", "train", *args], tmp_path / "lost.out", cwd=ROOT,
                         env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}).start()
    metrics_file, manifest = run / "metrics.jsonl", run / "services.json"

    def restarts() -> int:
        return next(r for r in json.loads(manifest.read_text()) if r["name"] == "engine-0")["restarts"]

    try:
        proc.wait_ready(reward_gate.reached.is_set, f"scoring request #{reward_gate.hold} held at the reward server")
        proc.wait_ready(lambda: metrics_file.exists() and bool(metrics_file.read_text().strip()),
                        "step 1 logged")  # version 1 is out
        engine = next(r for r in json.loads(manifest.read_text()) if r["name"] == "engine-0")
        os.kill(engine["pid"], signal.SIGKILL)
        proc.wait_ready(lambda: restarts() >= 1, "the engine restarted")
        reward_gate.released.set()
        proc.wait_exit("the run to finish")  # before the fix it waited forever
    finally:
        reward_gate.released.set()
        proc.stop()
    output = proc.output()
    assert proc.returncode == 0, output[-5000:]
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["async/staleness_max"] == 0 and m["async/late_trained"] == 0 for m in metrics)
