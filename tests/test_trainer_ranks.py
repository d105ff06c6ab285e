"""The loop's trainer as rank processes (local executor, gloo on CPU): 2 FSDP ranks train like 1.

The same deterministic batch of scored samples goes through the loop's learner (advantages in the
driver, log-probs and optimiser steps in the ranks) for two steps, once with one rank process and
once with two. Rewards differ within each group, so advantages and gradients are not zero and the
weights move: the comparison (losses, gradient norms, exported weights) is between two trained
models, not two copies of the initial one. Then, on the two-rank group: a weight push that an
engine refuses leaves the ranks usable, and a failure on the ranks names the rank and carries its
traceback.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from miles.config import build_config
from miles.executor.local import LocalExecutor
from miles.kernel import Kernel
from miles.loop.learner import Learner
from miles.placement import plan_placement
from miles.trainer.errors import TrainerCallError, TrainerRankError
from miles.trainer.group import TrainerGroup
from miles_contracts import Sample, TrainBatch
from safetensors.torch import load_file

pytestmark = pytest.mark.slow
STEPS = 2


@pytest.fixture(scope="module")
def tiny() -> Path:
    from miles_models.testing import tiny_model

    return tiny_model("dense")


def _samples(model: Path) -> list[Sample]:
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    samples = []
    for index in range(8):
        prompt, response = rng.randint(3, 6), rng.randint(4, 9)
        samples.append(Sample(
            tokens=[rng.randrange(vocab) for _ in range(prompt + response)], response_length=response,
            loss_mask=[1] * response, rollout_logprobs=[-rng.uniform(1, 5) for _ in range(response)],
            reward=float(index % 4 == 0) + 0.25 * (index % 3), group_index=index // 4, index=index,
        ))
    return samples


def _launch(model: Path, ranks: int, work: Path) -> tuple[TrainerGroup, LocalExecutor]:
    config = build_config({"model": {"name": str(model), "device": "cpu"}, "run": {"steps": STEPS},
                           "train": {"lr": 1e-3, "micro_batch_tokens": 32}, "resources": {"trainer_ranks": ranks}})
    executor = LocalExecutor(work, startup_timeout=300)
    return TrainerGroup.launch(config, executor, plan_placement(config.resources, executor.reserve(0)), work), executor


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    """One-rank and two-rank groups (launched together: their start-ups overlap), each trained for
    STEPS steps on the same samples through the loop's learner, then exported.
    ``{ranks: (group, metrics per step, export folder)}``."""
    launched = {}
    try:
        for ranks in (1, 2):
            work = tmp_path_factory.mktemp(f"ranks{ranks}")
            launched[ranks] = (*_launch(tiny, ranks, work), work)
        out = {}
        for ranks, (group, _, work) in launched.items():
            group.wait_ready()
            config = build_config(group._config_data)
            learner = Learner(config, Kernel.load(), group, pad_token_id=0)
            metrics = [learner.train(_samples(tiny)) for _ in range(STEPS)]
            group.export_hf(work / "hf")
            out[ranks] = (group, metrics, work / "hf")
        yield out
    finally:
        for group, executor, _ in launched.values():
            group.close()
            executor.shutdown()


def test_two_ranks_train_like_one(tiny, trained) -> None:
    _, one_metrics, one_dir = trained[1]
    _, two_metrics, two_dir = trained[2]
    for step, (one, two) in enumerate(zip(one_metrics, two_metrics, strict=True)):
        compared = [k for k in one if k.startswith(("train/", "advantage/"))]
        assert {"train/loss", "train/grad_norm", "train/train_rollout_logprob_abs_diff"} <= set(compared)
        for key in compared:
            assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), (step, key)
    # the second step saw the weights the first one made
    assert one_metrics[1]["train/grad_norm"] != pytest.approx(one_metrics[0]["train/grad_norm"], rel=1e-4)

    initial = load_file(tiny / "model.safetensors")
    one, two = load_file(one_dir / "model.safetensors"), load_file(two_dir / "model.safetensors")
    assert one.keys() == two.keys()
    moved = max((one[k].float() - initial[k].float()).abs().max().item() for k in one if k in initial)
    assert moved > 1e-4  # two optimiser steps at lr 1e-3 moved the weights...
    for name in one:  # ...and both trainers moved them the same way
        # Adam divides each update by the root of its second moment, so where a gradient entry is
        # near zero the ranks' other summation order (~1e-7 relative) moves its update visibly:
        # on this machine up to 1.5e-6 in 0.05% of one matrix's entries, against ~1e-3 per step
        # that every entry moves (one optimiser step of lr 1e-3). 2e-5 tells the two apart.
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=2e-5, msg=name)


def test_a_refused_push_leaves_the_ranks_usable(tiny, trained) -> None:
    group = trained[2][0]
    with pytest.raises(TrainerCallError, match="push_weights failed on 1 trainer rank"):
        group.push_weights(["http://127.0.0.1:9"], version=1)  # nothing listens there
    batch = TrainBatch.from_samples(_samples(tiny), 0)
    assert group.compute_logprobs(batch).shape == batch.tokens.shape  # both ranks are still in step


def test_a_failure_on_the_ranks_names_the_rank_and_its_traceback(tiny, trained) -> None:
    group = trained[2][0]
    batch = TrainBatch.from_samples(_samples(tiny), 0)
    with pytest.raises(TrainerRankError, match=r"trainer rank \d failed in compute_logprobs: RuntimeError: this "
                                               r"backend has no ref model(.|\n)*Traceback"):
        group.compute_logprobs(batch, model="ref")
    with pytest.raises(TrainerRankError):  # the group is broken: no more calls
        group.train_step(batch)
