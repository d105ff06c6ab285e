"""An estimator registered by a third party's plugin gets exactly what the built-ins get: batch
whitening (``algorithm.normalize_advantages``), on-policy distillation (``algorithm.opd_coef``) and
the passes its spec declares, applied by the kernel's learner after the estimator.

The plugin registers ``acme_grpo``, whose raw output is GRPO's; through the learner it must end
with bit-identical advantages to the built-in ``grpo``, and those must be the raw ones whitened
plus the distillation term (computed here by hand), so the terms really were applied.
"""

from __future__ import annotations

import pytest
import torch
from miles import hookimpl
from miles.config import build_config
from miles.kernel import Kernel
from miles.loop.learner import Learner
from miles.plugins import PluginSelection, load_plugins
from miles_algorithms.estimators import GRPO
from miles_contracts import AdvantageResult, AdvantageSpec, AlgorithmParams, Sample, Status, TrainBatch


class AcmeGRPO:
    """A third party's estimator: GRPO's raw advantages (it adds none of the kernel's terms)."""

    def __call__(self, batch, params):
        result = GRPO()(batch, params)
        return AdvantageResult(result.advantages.clone(), None, {"acme_calls": 1.0})


class AcmeCritic:
    """A third party's critic estimator: the advantage of a token is its critic value."""

    def __call__(self, batch, params):
        return AdvantageResult(torch.where(batch.loss_mask > 0, batch.values, 0.0), batch.values.clone())


class AcmePlugin:
    @hookimpl
    def miles_register_advantages(self, register) -> None:
        register("acme_grpo", AdvantageSpec(AcmeGRPO(), zero_sum_groups=True))
        register("acme_critic", AdvantageSpec(AcmeCritic(), needs_critic=True))


class RecordingBackend:
    """Stands in for the train backend: log-probs and values as fixed functions of the tokens, and
    the batch each ``train_step`` receives kept."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.trained: list[TrainBatch] = []

    def compute_logprobs(self, batch: TrainBatch, *, model: str = "actor") -> torch.Tensor:
        self.calls.append(model)
        return torch.where(batch.loss_mask > 0, -((batch.tokens % 7).float() + 1.0) / 4.0, 0.0)

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        self.calls.append("values")
        return torch.where(batch.loss_mask > 0, (batch.tokens % 5).float() - 2.0, 0.0)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        self.trained.append(batch)
        return {"loss": 0.0}


@pytest.fixture(scope="module")
def kernel() -> Kernel:
    selection = PluginSelection.from_settings(None, ())
    kernel = Kernel(load_plugins(selection), selection)
    kernel.register_plugin(AcmePlugin(), "acme")
    return kernel


def samples() -> list[Sample]:
    """Two prompt groups of three; varied lengths, a masked tool span, rewards of different spread."""
    g = torch.Generator().manual_seed(7)
    rewards = [1.0, 0.0, 0.5, 3.0, -1.0, 2.0]
    out = []
    for index, reward in enumerate(rewards):
        prompt, response = 2 + index % 3, 4 + (index * 3) % 5
        mask = [1] * response
        if index % 2 == 0:
            mask[1:3] = [0, 0]  # a tool's output inside the response
        logprobs = (-torch.rand(response, generator=g) * 2).tolist()
        out.append(Sample(tokens=torch.randint(3, 200, (prompt + response,), generator=g).tolist(),
                          response_length=response, loss_mask=mask, rollout_logprobs=logprobs, reward=reward,
                          status=Status.COMPLETED, group_index=index // 3, index=index))
    return out


def learn(kernel: Kernel, advantage: str, **algorithm) -> tuple[TrainBatch, dict[str, float], RecordingBackend]:
    """One learner step with ``advantage``; the batch the backend was asked to train on."""
    config = build_config({"algorithm": {"advantage": advantage, **algorithm},
                           "train": {"teacher_model": "teacher", "use_critic": advantage == "acme_critic"}},
                          kernel=kernel)
    backend = RecordingBackend()
    metrics = Learner(config, kernel, backend, pad_token_id=0).train(samples())
    (batch,) = backend.trained
    return batch, metrics, backend


@pytest.mark.parametrize("terms", [
    {"normalize_advantages": True, "opd_coef": 0.5},
    {"normalize_advantages": True},
    {"opd_coef": 0.5},
], ids=["whitened-and-distilled", "whitened", "distilled"])
def test_a_third_party_estimator_gets_whitening_and_distillation_like_grpo(kernel: Kernel, terms: dict) -> None:
    theirs, their_metrics, backend = learn(kernel, "acme_grpo", **terms)
    ours, our_metrics, _ = learn(kernel, "grpo", **terms)
    assert backend.calls == (["teacher"] if terms.get("opd_coef") else [])
    assert torch.equal(theirs.advantages, ours.advantages)
    assert their_metrics["advantage/acme_calls"] == 1.0  # the estimator's own metrics come along
    for name in ("advantage_mean", "advantage_std", "advantage_min", "advantage_max"):
        assert their_metrics[f"advantage/{name}"] == our_metrics[f"advantage/{name}"], name

    # and the terms were really applied: the raw GRPO advantages, whitened, plus opd_coef * (teacher - student)
    mask = theirs.loss_mask > 0
    raw = GRPO()(theirs, AlgorithmParams()).advantages  # GRPO reads neither term
    want = raw.double()
    if terms.get("normalize_advantages"):
        mean = want[mask].mean()
        std = (want[mask] - mean).square().mean().sqrt()
        want = (want - mean) / (std + 1e-8)
    if terms.get("opd_coef"):
        teacher = backend.compute_logprobs(theirs, model="teacher").double()
        want = want + terms["opd_coef"] * (teacher - theirs.rollout_logprobs.double())  # no old pass: student = rollout
    want = torch.where(mask, want, 0.0)
    torch.testing.assert_close(theirs.advantages.double(), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(theirs.advantages, raw)


def test_a_third_party_critic_estimator_gets_its_values_pass(kernel: Kernel) -> None:
    batch, _, backend = learn(kernel, "acme_critic", normalize_advantages=True)
    assert backend.calls == ["values"]  # declared by its spec: the learner ran the critic pass
    mask = batch.loss_mask > 0
    values = torch.where(mask, batch.values, 0.0)
    assert torch.equal(batch.returns, values)  # the kernel leaves returns alone
    a = batch.advantages[mask].double()
    assert abs(float(a.mean())) < 1e-6 and float(a.std(unbiased=False)) == pytest.approx(1.0, abs=1e-5)


def test_the_config_refuses_a_third_party_critic_estimator_without_a_critic(kernel: Kernel) -> None:
    from miles.errors import ConfigError

    with pytest.raises(ConfigError, match="algorithm.advantage 'acme_critic' needs a critic: set train.use_critic: true"):
        build_config({"algorithm": {"advantage": "acme_critic"}}, kernel=kernel)
