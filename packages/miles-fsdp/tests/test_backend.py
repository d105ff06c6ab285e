"""The fsdp backend in one process (a world of one, still through FSDP2), on tiny real models."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from miles import hookimpl
from miles.context import context_for
from miles.kernel import Kernel
from miles.plugins import PluginSelection, load_plugins
from miles_algorithms import objective
from miles_contracts import Process
from miles_contracts.testing.backend import check_train_backend, make_test_batch, plain_logprobs
from miles_fsdp.optim import LRMultiplier


def _trainable_batch(model_dir, backend=None, sign: float = 1.0, **kwargs):
    batch = make_test_batch(model_dir, **kwargs)
    advantages = torch.where(batch.loss_mask > 0, torch.full_like(batch.loss_mask, sign), torch.zeros_like(batch.loss_mask))
    old = backend.compute_logprobs(batch) if backend is not None else None
    return replace(batch, advantages=advantages, old_logprobs=old)


def _plain_entropy(model_dir, batch, temperature: float = 1.0) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits.float() / temperature
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    entropy = torch.cat([torch.zeros(batch.size, 1), -(logp.exp() * logp).sum(-1)], dim=1)
    return torch.where(batch.loss_mask > 0, entropy, torch.zeros_like(entropy))


def _actor_gradients(backend, batch, with_entropy: bool = False) -> dict[str, torch.Tensor]:
    """Accumulate one batch's actor gradient (no optimiser step) and return it, full and named."""
    params = backend.config.algorithm
    policy_loss = backend.kernel.policy_losses().get("ppo_clip").loss
    correction = backend.kernel.mismatch_corrections().get("none").correct

    def loss_fn(micro, outputs):
        entropy = outputs[1] if with_entropy else None
        return objective.actor_loss(outputs[0], micro, params, policy_loss=policy_loss, correction=correction, entropy=entropy)

    backend.runner.accumulate("train", backend.actor, objective.prepare_batch(batch), loss_fn, with_entropy=with_entropy)
    grads = {n: p.grad.full_tensor().clone() for n, p in backend.actor.hf.named_parameters()}
    backend.actor.zero_grad(set_to_none=True)
    return grads


# ----------------------------------------------------------------------------- log-probs


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("packing", [True, False])
def test_logprobs_and_entropy_match_a_plain_forward(request, backend_factory, kind: str, packing: bool) -> None:
    model_dir = request.getfixturevalue(f"tiny_{kind}")
    backend = backend_factory(model_dir, fsdp={"packing": packing, "logprob_chunk_size": 7}, micro_batch_tokens=20)
    batch = make_test_batch(model_dir)
    logprobs, entropy = backend.compute_logprobs_and_entropy(batch)
    torch.testing.assert_close(logprobs, plain_logprobs(model_dir, batch), rtol=0, atol=1e-4)
    torch.testing.assert_close(entropy, _plain_entropy(model_dir, batch), rtol=0, atol=1e-4)
    assert bool((logprobs[batch.loss_mask == 0] == 0).all())


def test_logprobs_follow_the_rollout_temperature(tiny_dense, backend_factory) -> None:
    backend = backend_factory(tiny_dense, temperature=0.7)
    batch = make_test_batch(tiny_dense)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dense), dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits / 0.7
    want = torch.log_softmax(logits[:, :-1], -1).gather(2, batch.tokens[:, 1:, None]).squeeze(2)
    want = torch.cat([torch.zeros(batch.size, 1), want], 1) * batch.loss_mask
    torch.testing.assert_close(backend.compute_logprobs(batch), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_sdpa_preference_holds_in_forward_and_recomputation(tiny_dense, backend_factory, checkpointing: bool) -> None:
    """``fsdp.sdpa_backends`` restricts the attention kernels in forward and in backward's recompute."""
    batch = _trainable_batch(tiny_dense)
    plain = backend_factory(tiny_dense, micro_batch_tokens=20, gradient_checkpointing=checkpointing)
    want = _actor_gradients(plain, objective.prepare_batch(batch))
    math_only = backend_factory(tiny_dense, micro_batch_tokens=20, gradient_checkpointing=checkpointing,
                                fsdp={"sdpa_backends": ["math"]})
    got = _actor_gradients(math_only, objective.prepare_batch(batch))
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)

    # only a kernel this CPU lacks: attention fails, so the preference is really applied
    refused = backend_factory(tiny_dense, micro_batch_tokens=20, fsdp={"sdpa_backends": ["cudnn"]})
    with pytest.raises(RuntimeError, match="(?i)no (available kernel|viable backend)"):
        refused.compute_logprobs(batch)


@pytest.mark.parametrize("entropy_coef", [0.0, 0.05])
def test_gradient_equals_plain_autograd_through_full_logits(tiny_dense, backend_factory, entropy_coef: float) -> None:
    from transformers import AutoModelForCausalLM

    backend = backend_factory(tiny_dense, micro_batch_tokens=20, temperature=0.8,
                              fsdp={"logprob_chunk_size": 5}, algorithm={"entropy_coef": entropy_coef})
    batch = objective.prepare_batch(_trainable_batch(tiny_dense, backend, sign=-1.0))
    got = _actor_gradients(backend, batch, with_entropy=entropy_coef != 0)

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dense), dtype=torch.float32)
    logits = model(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits / 0.8  # [B, T, V]
    all_logp = torch.log_softmax(logits[:, :-1], -1)
    logp = torch.cat([torch.zeros(batch.size, 1), all_logp.gather(2, batch.tokens[:, 1:, None]).squeeze(2)], 1)
    entropy = torch.cat([torch.zeros(batch.size, 1), -(all_logp.exp() * all_logp).sum(-1)], 1)
    loss, _ = objective.actor_loss(logp, batch, backend.config.algorithm,
                                   policy_loss=backend.kernel.policy_losses().get("ppo_clip").loss,
                                   correction=backend.kernel.mismatch_corrections().get("none").correct,
                                   entropy=entropy if entropy_coef else None)
    loss.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packed_and_padded_micro_batches_give_the_same_gradient(tiny_dense, backend_factory) -> None:
    packed = backend_factory(tiny_dense, fsdp={"packing": True}, micro_batch_tokens=30)
    padded = backend_factory(tiny_dense, fsdp={"packing": False}, micro_batch_tokens=30)
    batch = _trainable_batch(tiny_dense, packed)
    torch.testing.assert_close(packed.compute_logprobs(batch), padded.compute_logprobs(batch), rtol=0, atol=1e-5)
    a, b = _actor_gradients(packed, batch), _actor_gradients(padded, batch)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6, msg=name)


def test_one_or_many_micro_batches_give_the_same_gradient(tiny_dense, backend_factory) -> None:
    whole = backend_factory(tiny_dense, micro_batch_tokens=10_000)
    pieces = backend_factory(tiny_dense, micro_batch_tokens=10)
    batch = _trainable_batch(tiny_dense, whole)
    assert len(whole.runner.my_micro_batches(batch)) == 1 and len(pieces.runner.my_micro_batches(batch)) == 5
    a, b = _actor_gradients(whole, batch), _actor_gradients(pieces, batch)
    assert any(float(g.abs().max()) > 0 for g in a.values())
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6, msg=name)


def test_activation_checkpointing_gives_the_same_gradient(tiny_dense, backend_factory) -> None:
    plain = backend_factory(tiny_dense)
    recomputed = backend_factory(tiny_dense, gradient_checkpointing=True)
    batch = _trainable_batch(tiny_dense, plain)
    calls = {"plain": 0, "recomputed": 0}
    for key, backend in (("plain", plain), ("recomputed", recomputed)):  # a module inside the layer
        backend.actor.hf.model.layers[0].mlp.register_forward_pre_hook(lambda *_, k=key: calls.__setitem__(k, calls[k] + 1))
    a, b = _actor_gradients(plain, batch), _actor_gradients(recomputed, batch)
    assert calls["recomputed"] == 2 * calls["plain"] > 0, "each layer should run again in backward"
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-7, msg=name)


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_conformance_suite(request, make_config, tmp_path, kind: str) -> None:
    from miles_fsdp.backend import FSDPBackend

    model_dir = request.getfixturevalue(f"tiny_{kind}")
    ctx = context_for(make_config(model_dir), Process.trainer_rank(0))
    bridge = ctx.kernel.model_bridge(json.loads((model_dir / "config.json").read_text()))
    report = check_train_backend(lambda: FSDPBackend(ctx), model_dir, work_dir=tmp_path, bridge=bridge)
    assert report.loss_after < report.loss_before and report.logprob_max_diff < 1e-4


def test_conformance_suite_catches_broken_backends(tiny_dense, make_config, tmp_path) -> None:
    from miles_fsdp.backend import FSDPBackend

    class ShiftedLogprobs(FSDPBackend):
        def compute_logprobs(self, batch, *, model="actor"):
            return super().compute_logprobs(batch, model=model) * 1.01

    class LosesATensor(FSDPBackend):
        def named_weights(self, dtype=None):
            return ((n, t) for n, t in super().named_weights(dtype) if "layers.1.mlp.up_proj" not in n)

    ctx = context_for(make_config(tiny_dense), Process.trainer_rank(0))
    bridge = ctx.kernel.model_bridge(json.loads((tiny_dense / "config.json").read_text()))
    for broken, message in ((ShiftedLogprobs, "differ from the plain forward"), (LosesATensor, "missing")):
        made = []

        def factory(cls=broken, made=made):
            made.append(cls(ctx))
            return made[-1]

        with pytest.raises(AssertionError, match=message):
            check_train_backend(factory, tiny_dense, work_dir=tmp_path, bridge=bridge)
        for backend in made:
            backend.close()


def test_moe_trains_and_exports(tiny_moe, backend_factory, tmp_path) -> None:
    backend = backend_factory(tiny_moe, micro_batch_tokens=16)
    batch = _trainable_batch(tiny_moe, backend)
    first = backend.train_step(batch)
    second = backend.train_step(batch)
    assert second["loss"] < first["loss"]
    backend.export_hf(tmp_path / "moe")
    exported = plain_logprobs(tmp_path / "moe", batch)
    torch.testing.assert_close(exported, backend.compute_logprobs(batch), rtol=0, atol=1e-4)


def test_resume_gives_bitwise_the_same_weights_and_counts_as_training_straight(tiny_dense, backend_factory, tmp_path) -> None:
    options = dict(lr_schedule="cosine", warmup_steps=1, steps=4, micro_batch_tokens=20, weight_decay=0.01)
    batches = [_trainable_batch(tiny_dense, sign=s, seed=i) for i, s in enumerate([1.0, -1.0, 1.0, -1.0])]
    # the second is skipped (a gradient that is not finite): the checkpoint keeps that count too
    batches[1] = replace(batches[1], advantages=torch.where(batches[1].loss_mask > 0, float("nan"), 0.0))

    straight = backend_factory(tiny_dense, **options)
    for batch in batches:
        straight.train_step(batch)
    want = list(straight.named_weights())

    first = backend_factory(tiny_dense, **options)
    for batch in batches[:2]:
        first.train_step(batch)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "caller.json").write_text("{}")  # the run's own files share the folder
    first.save_checkpoint(tmp_path / "ckpt", {"data": {"position": 2, "epoch": 0}})
    first.close()
    assert (tmp_path / "ckpt" / "caller.json").read_text() == "{}"
    resumed = backend_factory(tiny_dense, **options)
    assert resumed.load_checkpoint(tmp_path / "ckpt") == {"data": {"position": 2, "epoch": 0}}
    assert (resumed.optimizer_steps, resumed.skipped_steps) == (1, 1)
    for batch in batches[2:]:
        resumed.train_step(batch)
    got = list(resumed.named_weights())
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want, strict=True):
        assert torch.equal(a, b), f"{name} differs after resuming"
    assert resumed.trained[0].optimizer.param_groups[0]["lr"] == straight.trained[0].optimizer.param_groups[0]["lr"]
    assert (resumed.optimizer_steps, resumed.skipped_steps) == (straight.optimizer_steps, straight.skipped_steps) == (3, 1)


def test_updates_per_step_takes_that_many_optimizer_steps(tiny_dense, backend_factory) -> None:
    backend = backend_factory(tiny_dense, updates_per_step=2, lr=0.05)
    metrics = backend.train_step(_trainable_batch(tiny_dense))  # no old log-probs: the backend computes them
    assert metrics["optimizer_steps"] == 2 and backend.optimizer_steps == 2
    # the second mini-batch saw the policy moved by the first, relative to the proximal one
    assert metrics["ratio"] != pytest.approx(1.0, abs=1e-6) and metrics["pg_clipfrac"] > 0
    with pytest.raises(ValueError, match="updates_per_step"):
        backend_factory(tiny_dense, updates_per_step=9).train_step(_trainable_batch(tiny_dense))


def test_critic_values_and_training(tiny_dense, backend_factory) -> None:
    backend = backend_factory(tiny_dense, use_critic=True, critic_lr=1e-3, fsdp={"value_head_std": 0.02})
    batch = make_test_batch(tiny_dense)
    values = backend.compute_values(batch)
    assert values.shape == batch.tokens.shape and bool((values[batch.loss_mask == 0] == 0).all())
    returns = torch.where(batch.loss_mask > 0, torch.full_like(values, 0.5), torch.zeros_like(values))
    step = replace(_trainable_batch(tiny_dense, backend), values=values, returns=returns)
    losses = [backend.train_step(step)["critic/value_loss"] for _ in range(3)]
    assert losses[-1] < losses[0]


def test_kl_to_the_reference_is_reported(tiny_dense, backend_factory) -> None:
    backend = backend_factory(tiny_dense, use_reference=True)
    batch = _trainable_batch(tiny_dense, backend)
    batch = replace(batch, ref_logprobs=backend.compute_logprobs(batch, model="ref"))
    torch.testing.assert_close(batch.ref_logprobs, batch.old_logprobs, rtol=0, atol=0)
    first = backend.train_step(batch)
    second = backend.train_step(batch)
    assert first["kl_loss"] == pytest.approx(0.0, abs=1e-6) and second["kl_loss"] > 0


# ----------------------------------------------------------------------------- forward wrappers


class _PhaseRecorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int]] = []

    @hookimpl(wrapper=True)
    def miles_forward(self, ctx):
        assert ctx.backend == "fsdp"
        self.seen.append((ctx.phase, type(ctx.model).__name__, ctx.batch.size))
        result = yield
        return result


def test_every_forward_goes_through_the_wrapper_hook(tiny_dense, backend_factory) -> None:
    recorder = _PhaseRecorder()
    selection = PluginSelection.from_settings(None, ())
    kernel = Kernel(load_plugins(selection), selection)  # a kernel of this test's own: the backend must use it
    kernel.register_plugin(recorder, name="test-phase-recorder")
    backend = backend_factory(tiny_dense, kernel=kernel, use_reference=True, use_critic=True,
                              teacher_model=str(tiny_dense), micro_batch_tokens=20)
    batch = make_test_batch(tiny_dense)
    old = backend.compute_logprobs(batch)
    backend.compute_logprobs(batch, model="ref")
    backend.compute_logprobs(batch, model="teacher")
    values = backend.compute_values(batch)
    advantages = torch.where(batch.loss_mask > 0, torch.ones_like(old), torch.zeros_like(old))
    backend.train_step(replace(batch, old_logprobs=old, advantages=advantages, values=values, returns=advantages))
    phases = [p for p, _, _ in recorder.seen]
    assert set(phases) == {"old_logprobs", "ref_logprobs", "teacher_logprobs", "values", "train", "critic_train"}
    micro_batches = len(backend.runner.my_micro_batches(batch))
    assert micro_batches > 1 and all(phases.count(p) == micro_batches for p in set(phases))
    assert {m for p, m, _ in recorder.seen if p == "train"} == {"LlamaForCausalLM"}
    assert {m for p, m, _ in recorder.seen if p == "values"} == {"LlamaModel"}


# ----------------------------------------------------------------------------- errors


def test_clear_errors_for_bad_calls(tiny_dense, backend_factory, tmp_path) -> None:
    backend = backend_factory(tiny_dense)
    batch = make_test_batch(tiny_dense)
    with pytest.raises(ValueError, match="advantages"):
        backend.train_step(batch)
    with pytest.raises(RuntimeError, match="use_reference"):
        backend.compute_logprobs(batch, model="ref")
    with pytest.raises(RuntimeError, match="use_critic"):
        backend.compute_values(batch)
    with pytest.raises(TypeError, match="JSON"):
        backend.save_checkpoint(tmp_path / "bad", {"tensor": torch.zeros(2)})
    assert not (tmp_path / "bad").exists()
    with pytest.raises(FileNotFoundError, match="not a miles-fsdp checkpoint"):
        backend.load_checkpoint(tmp_path)
    backend.save_checkpoint(tmp_path / "cut", {})
    (tmp_path / "cut" / "trainer_state.json").unlink()  # as if the save had died before its end
    with pytest.raises(FileNotFoundError, match="not a miles-fsdp checkpoint"):
        backend.load_checkpoint(tmp_path / "cut")


def test_a_failed_start_leaves_no_process_group(make_config, tmp_path) -> None:
    from miles_fsdp.backend import FSDPBackend

    with pytest.raises(Exception, match="nope"):
        FSDPBackend(context_for(make_config(tmp_path / "nope"), Process.trainer_rank(0)))
    assert not torch.distributed.is_initialized()


def test_lr_schedule_shapes() -> None:
    assert [round(LRMultiplier("constant", 2, 10)(s), 4) for s in range(4)] == [0.3333, 0.6667, 1.0, 1.0]
    linear = LRMultiplier("linear", 0, 4)
    assert [linear(s) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    cosine = LRMultiplier("cosine", 0, 2)
    assert cosine(0) == 1.0 and cosine(1) == pytest.approx(0.5) and cosine(2) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="unknown lr schedule"):
        LRMultiplier("step", 0, 1)
