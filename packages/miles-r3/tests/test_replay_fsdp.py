"""Routing replay end to end on CPU, fp32: a real engine samples from the tiny Qwen3-MoE and reports
its routing, the ``single_turn`` generator keeps it on the samples, and the ``fsdp`` backend's
forwards are forced onto it. What the experts modules actually receive is watched independently of
the replay hooks (a forward pre-hook on each ``Qwen3MoeExperts``)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from miles.builtin.generators import single_turn
from miles.config import MilesConfig
from miles.context import context_for
from miles.engine_client import HttpEngineClient
from miles.sections import ModelSection, RolloutSection, RunSection, TrainSection
from miles_contracts import GenerateContext, MoeLayerMap, Process, Sample, Status, TrainBatch
from miles_contracts.wire.engine import SamplingParams
from miles_fsdp.backend import FSDPBackend
from miles_fsdp.config import FSDPSection
from miles_r3 import plugin as r3
from miles_r3.capture import RoutedExpertsCapture
from miles_r3.config import R3Section
from miles_r3.experts import ROUTED_EXPERTS

pytestmark = pytest.mark.slow  # a real engine (shared by the package's tests) and three fsdp backends

PROMPTS = ["What is 2+2?", "Tell me a story about", "The capital of France is", "1 2 3 4"]


@pytest.fixture(scope="module")
def rollout_samples(moe_engine_url: str, tiny_moe: Path, moe_map: MoeLayerMap) -> list[Sample]:
    """Four rollouts of the engine, their routing captured (rewards 1, one prompt group)."""
    from transformers import AutoTokenizer

    async def generate() -> list[Sample]:
        client = HttpEngineClient(moe_engine_url)
        params = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True, sampling_seed=3)
        ctx = GenerateContext(engine=client, tokenizer=AutoTokenizer.from_pretrained(tiny_moe), sampling_params=params,
                              max_context_len=512, run=context_for(process=Process.driver()),
                              captures=[RoutedExpertsCapture(moe_map)])
        try:
            return list(await asyncio.gather(*(single_turn(Sample(prompt=p, index=i), ctx) for i, p in enumerate(PROMPTS))))
        finally:
            await client.aclose()

    samples = asyncio.run(generate())
    for s in samples:
        assert s.status is Status.TRUNCATED and s.stash[ROUTED_EXPERTS].positions == len(s.tokens) - 1
        s.reward = 1.0
    return samples


@pytest.fixture(scope="module")
def rollout(rollout_samples: list[Sample]) -> TrainBatch:
    return TrainBatch.from_samples(rollout_samples, pad_token_id=0)


@pytest.fixture
def replay_settings() -> Iterator[Any]:
    """Set this process's r3 settings (what ``miles_configure`` does in a run); restored after."""
    saved = r3.STATE._settings

    def use(**fields: Any) -> None:
        r3.STATE.settings = R3Section(enabled=True, **fields)
        r3.STATE.stats.flush()

    yield use
    r3.STATE.settings = saved


def config_for(tiny_moe: Path, **train: Any) -> MilesConfig:
    return MilesConfig(
        model=ModelSection(name=str(tiny_moe), device="cpu"), run=RunSection(steps=2), rollout=RolloutSection(temperature=1.0),
        train=TrainSection(lr=1e-3, micro_batch_tokens=4096, **train), extra={"fsdp": FSDPSection(packing=False)},
    )


def backend_with(tiny_moe: Path, moe_map: MoeLayerMap, *, router_noise: float, **train: Any) -> FSDPBackend:
    """An fsdp backend on the tiny MoE whose routers are perturbed by ``router_noise`` x their std
    (padded micro-batches: the experts see ``[b * t]`` tokens row-major)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in moe_map.moe_layers:
            weight = model.get_submodule(moe_map.router_path(layer)).weight
            weight.add_(torch.randn(weight.shape, generator=generator) * router_noise * weight.std())
    return FSDPBackend(context_for(config_for(tiny_moe, **train), Process.trainer_rank(0)), actor=model)


class ExpertsWatch:
    """The expert indices each MoE layer's experts module receives, forward by forward."""

    def __init__(self, model: torch.nn.Module, moe_map: MoeLayerMap) -> None:
        self.seen: list[list[torch.Tensor]] = [[] for _ in moe_map.moe_layers]
        self.handles = []
        for column, layer in enumerate(moe_map.moe_layers):
            experts = model.get_submodule(moe_map.router_path(layer).rsplit(".", 1)[0]).experts
            self.handles.append(experts.register_forward_pre_hook(
                lambda module, args, column=column: self.seen[column].append(args[1].detach().clone())))

    def agreement(self, batch: TrainBatch) -> float:
        """Share of (recorded token, layer, forward) triples routed exactly as the rollout was."""
        table = batch.extra(ROUTED_EXPERTS)
        b, t, _, _ = table.shape
        recorded = (table[..., 0, 0] < 4).reshape(-1)
        same = total = 0
        for column, forwards in enumerate(self.seen):
            want = table[:, :, column].reshape(b * t, -1).long().sort(-1).values[recorded]
            for got in forwards:
                same += int((got.long().sort(-1).values[recorded] == want).all(-1).sum())
                total += int(recorded.sum())
        for handle in self.handles:
            handle.remove()
        return same / total


def mean_abs_diff(logprobs: torch.Tensor, batch: TrainBatch) -> float:
    return float(((logprobs - batch.rollout_logprobs).abs() * batch.loss_mask).sum() / batch.loss_mask.sum())


def test_replay_routes_every_token_as_the_rollout_did(rollout, tiny_moe, moe_map, replay_settings) -> None:
    results = {}
    for replay in (False, True):
        replay_settings(replay=replay)
        backend = backend_with(tiny_moe, moe_map, router_noise=0.0)
        watch = ExpertsWatch(backend.actor.hf, moe_map)
        logprobs = backend.compute_logprobs(rollout)
        results[replay] = (watch.agreement(rollout), mean_abs_diff(logprobs, rollout), r3.STATE.stats.flush())
        backend.close()
    (used_off, diff_off, stats_off), (used_on, diff_on, stats_on) = results[False], results[True]
    assert used_on == 1.0  # 100% of the rollout's tokens, every MoE layer
    assert diff_on <= diff_off + 1e-6
    assert stats_on["r3/old_logprobs/replayed_tokens"] == sum(int(n) - 1 for n in rollout.attention_mask.sum(1))
    assert stats_off["r3/old_logprobs/routing_agreement"] == used_off  # measured without forcing


def test_replay_removes_a_forced_routing_disagreement(rollout, tiny_moe, moe_map, replay_settings) -> None:
    """Perturbed router weights make the trainer route differently from the engine; replay forces
    the rollout's experts back, in the log-prob pass and in a checkpointed training step (whose
    backward recomputes every layer), and the log-prob gap shrinks."""
    batch = dataclasses.replace(rollout, advantages=torch.where(rollout.loss_mask > 0, 1.0, 0.0))
    runs = {}
    for replay in (False, True):
        replay_settings(replay=replay)
        backend = backend_with(tiny_moe, moe_map, router_noise=1.0, gradient_checkpointing=True)
        watch = ExpertsWatch(backend.actor.hf, moe_map)
        logprobs = backend.compute_logprobs(batch)
        metrics = backend.train_step(batch)
        runs[replay] = (watch, mean_abs_diff(logprobs, batch), metrics, r3.STATE.stats.flush())
        backend.close()
    (watch_off, diff_off, _, stats_off), (watch_on, diff_on, metrics_on, stats_on) = runs[False], runs[True]
    assert stats_off["r3/old_logprobs/routing_agreement"] < 0.8  # the perturbation really moves routing
    assert watch_off.agreement(batch) < 0.8
    assert [len(forwards) for forwards in watch_on.seen] == [3, 3]  # log-prob pass, training forward, recomputation
    assert watch_on.agreement(batch) == 1.0
    assert diff_on < 0.5 * diff_off
    assert stats_on["r3/train/routing_agreement"] < 0.8  # the trainer's own choice still differs: it was overruled
    assert metrics_on["train_rollout_logprob_abs_diff"] == pytest.approx(diff_on, abs=1e-6)


def test_each_step_reports_routing_agreement_next_to_the_logprob_gap(rollout_samples, tiny_moe, moe_map, replay_settings) -> None:
    """The loop's learner trains on the samples (their routing reaches the batch on its own) and the
    step's metrics carry the agreement the r3 plugin adds at ``miles_train_step_end`` (called in a
    trainer rank process after each train step; the backend runs in this process here)."""
    from miles.loop.learner import Learner

    replay_settings(replay=True)
    backend = backend_with(tiny_moe, moe_map, router_noise=1.0)
    kernel = backend.kernel  # the rank's kernel: its r3 plugin adds the metrics
    rank_side = _RankSide(backend, kernel)
    metrics = Learner(config_for(tiny_moe), kernel, rank_side, pad_token_id=0).train(rollout_samples)
    backend.close()
    assert metrics["r3/train/replayed_tokens"] == sum(len(s.tokens) - 1 for s in rollout_samples)
    assert 0.0 < metrics["r3/train/routing_agreement"] < 1.0 and 0.0 < metrics["r3/train/expert_overlap"] < 1.0
    assert metrics["train/train_rollout_logprob_abs_diff"] > 0.0


class _RankSide:
    """The backend as the driver sees it through a trainer rank: each train step followed by the
    rank's ``miles_train_step_end`` (what ``miles.trainer.rank.RankWorker`` does)."""

    def __init__(self, backend, kernel) -> None:
        self.backend, self.kernel = backend, kernel

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def train_step(self, batch):
        metrics = dict(self.backend.train_step(batch))
        self.kernel.train_step_end(metrics)
        return metrics
