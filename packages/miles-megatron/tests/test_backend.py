"""The megatron backend in one process (a world of one, through megatron-core's real schedules,
DDP, optimizer and distributed checkpointing), on tiny real models."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import replace

import pytest
import torch
from miles import hookimpl
from miles.context import context_for
from miles.kernel import Kernel
from miles.plugins import PluginSelection, load_plugins
from miles_contracts import Process
from miles_contracts.testing.backend import check_train_backend, make_test_batch, plain_logprobs


def test_conformance_dense(tiny_dense, make_config, tmp_path) -> None:
    from miles_megatron.backend import MegatronBackend

    ctx = context_for(make_config(tiny_dense), Process.trainer_rank(0))
    bridge = ctx.kernel.model_bridge(json.loads((tiny_dense / "config.json").read_text()))
    report = check_train_backend(lambda: MegatronBackend(ctx), tiny_dense, work_dir=tmp_path, bridge=bridge)
    assert report.bridge == "llama" and report.loss_after < report.loss_before


def test_moe_logprobs_entropy_and_weights(tiny_moe, backend_factory) -> None:
    from miles_contracts.testing.bridge import load_hf_checkpoint

    backend = backend_factory(tiny_moe, megatron={"logprob_chunk_size": 7})
    batch = make_test_batch(tiny_moe)
    logprobs, entropy = backend.compute_logprobs_and_entropy(batch)
    torch.testing.assert_close(logprobs, plain_logprobs(tiny_moe, batch), rtol=0, atol=1e-4)
    assert bool((entropy[batch.loss_mask > 0] > 0).all()) and bool((entropy[batch.loss_mask == 0] == 0).all())
    stored, _ = load_hf_checkpoint(tiny_moe)
    weights = dict(backend.named_weights())
    assert weights.keys() == stored.keys() and all(torch.equal(weights[n], stored[n]) for n in stored)


def test_router_load_balancing_loss_is_an_option(tiny_moe, backend_factory) -> None:
    """The load-balancing loss reaches the routers only (the policy loss is the same)."""
    from miles_megatron.testing import hf_gradients

    batch = make_test_batch(tiny_moe)
    grads = {}
    for coef in (0.0, 0.5):
        backend = backend_factory(tiny_moe, megatron={"moe_aux_loss_coef": coef, "distributed_optimizer": False})
        old = backend.compute_logprobs(batch)
        advantages = torch.where(batch.loss_mask > 0, torch.ones_like(old), torch.zeros_like(old))
        grads[coef] = hf_gradients(backend, replace(batch, advantages=advantages, old_logprobs=old, rollout_logprobs=old))
        backend.close()
    router = "model.layers.0.mlp.gate.weight"
    assert not torch.allclose(grads[0.0][router], grads[0.5][router], atol=1e-6)
    torch.testing.assert_close(grads[0.0]["model.norm.weight"], grads[0.5]["model.norm.weight"], rtol=0, atol=0)


def test_unclaimed_model_names_the_installed_bridges(tiny_dense, make_config, tmp_path) -> None:
    import shutil

    from miles.errors import PluginError
    from miles_megatron.backend import MegatronBackend

    odd = tmp_path / "odd"
    shutil.copytree(tiny_dense, odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}))
    with pytest.raises(PluginError, match="llama.*qwen3|qwen3.*llama"):
        MegatronBackend(context_for(make_config(odd), Process.trainer_rank(0)))


def test_bad_layouts_are_refused_with_the_sizes(tiny_dense, make_config) -> None:
    from miles_megatron.backend import MegatronBackend

    with pytest.raises(ValueError, match="tensor_parallel x pipeline_parallel x context_parallel = 2 x 1 x 1"):
        MegatronBackend(context_for(make_config(tiny_dense, megatron={"tensor_parallel": 2}), Process.trainer_rank(0)))


def test_reference_model_scores_the_starting_weights(tiny_dense, backend_factory) -> None:
    backend = backend_factory(tiny_dense, use_reference=True)
    batch = make_test_batch(tiny_dense)
    start = backend.compute_logprobs(batch)
    advantages = torch.where(batch.loss_mask > 0, torch.ones_like(start), torch.zeros_like(start))
    backend.train_step(replace(batch, advantages=advantages, rollout_logprobs=start))
    torch.testing.assert_close(backend.compute_logprobs(batch, model="ref"), start, rtol=0, atol=1e-6)
    assert not torch.allclose(backend.compute_logprobs(batch), start, atol=1e-4)


def test_one_step_matches_the_fsdp_backend(tiny_dense, backend_factory, make_config) -> None:
    """Same model, batch, loss and AdamW: the weights after one optimizer step agree."""
    from miles_fsdp.backend import FSDPBackend
    from miles_fsdp.config import FSDPSection

    ctx = context_for(make_config(tiny_dense), Process.trainer_rank(0))
    fsdp = FSDPBackend(ctx.with_config(dataclasses.replace(ctx.config, extra={"fsdp": FSDPSection()})))
    megatron = backend_factory(tiny_dense)
    try:
        batch = make_test_batch(tiny_dense)
        old = fsdp.compute_logprobs(batch)
        advantages = torch.where(batch.loss_mask > 0, torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(1)), torch.zeros_like(old))
        step = replace(batch, advantages=advantages, old_logprobs=old, rollout_logprobs=old)
        want, got = fsdp.train_step(step), megatron.train_step(step)
        for key in ("loss", "pg_loss", "grad_norm", "entropy", "pg_clipfrac"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
        fsdp_weights = dict(fsdp.named_weights())
        for name, tensor in megatron.named_weights():
            torch.testing.assert_close(tensor, fsdp_weights[name], rtol=0, atol=1e-5, msg=name)
    finally:
        megatron.close()  # before FSDP, which owns the process group here
        fsdp.close()


class _RouterRecorder:
    """A ``miles_forward`` wrapper like R3's: finds the MoE routers and the token map of each forward."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, list[int], bool]] = []

    @hookimpl(wrapper=True)
    def miles_forward(self, ctx):
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for m in ctx.model.modules() if isinstance(m, TopKRouter)]
        inputs = ctx.state["inputs"]
        # every real token maps to a (row, column) of the micro-batch with that token id
        real = inputs.token_index[:, 0] >= 0
        rows, cols = inputs.token_index[real].unbind(1)
        same = bool(torch.equal(ctx.batch.tokens[rows, cols], inputs.input_ids[0, real]))
        self.seen.append((ctx.phase, type(ctx.model).__name__, [r.layer_number for r in routers],
                          same and all(r.router_replay is not None for r in routers)))
        return (yield)


def test_forward_wrappers_see_the_megatron_model_its_routers_and_token_map(tiny_moe, backend_factory) -> None:
    recorder = _RouterRecorder()
    selection = PluginSelection.from_settings(None, ())
    kernel = Kernel(load_plugins(selection), selection)  # a kernel of this test's own: the backend must use it
    kernel.register_plugin(recorder, name="test-router-recorder")
    backend = backend_factory(tiny_moe, kernel=kernel)
    batch = make_test_batch(tiny_moe)
    old = backend.compute_logprobs(batch)
    advantages = torch.where(batch.loss_mask > 0, torch.ones_like(old), torch.zeros_like(old))
    backend.train_step(replace(batch, old_logprobs=old, advantages=advantages))
    assert {phase for phase, *_ in recorder.seen} == {"old_logprobs", "train"}
    assert all(model == "GPTModel" and layers == [1, 2] and ok for _, model, layers, ok in recorder.seen)


def test_a_skipped_step_is_kept_by_a_checkpoint_and_the_schedule_resumes_where_it_was(tiny_dense, backend_factory,
                                                                                    tmp_path) -> None:
    """A gradient that is not finite skips the optimizer step but advances the learning-rate
    schedule; a resumed backend must count it too, or its schedule runs one step behind."""
    backend = backend_factory(tiny_dense, warmup_steps=4)
    batch = make_test_batch(tiny_dense)
    old = backend.compute_logprobs(batch)
    good = replace(batch, advantages=torch.where(batch.loss_mask > 0, 1.0, 0.0), old_logprobs=old, rollout_logprobs=old)
    assert backend.train_step(good)["skipped_steps"] == 0.0
    poisoned = replace(good, advantages=torch.where(batch.loss_mask > 0, float("nan"), 0.0))
    before = dict(backend.named_weights())
    after_nan = backend.train_step(poisoned)
    assert after_nan["skipped_steps"] == 1.0 and after_nan["optimizer_steps"] == 1.0
    assert all(torch.equal(before[name], tensor) for name, tensor in backend.named_weights())  # no NaN applied
    backend.save_checkpoint(tmp_path / "ckpt", {"note": "x"})
    want = backend.train_step(good)

    resumed = backend_factory(tiny_dense, warmup_steps=4)
    assert resumed.load_checkpoint(tmp_path / "ckpt") == {"note": "x"}
    got = resumed.train_step(good)
    assert (got["optimizer_steps"], got["skipped_steps"]) == (want["optimizer_steps"], want["skipped_steps"]) == (2.0, 1.0)
    assert got["lr"] == want["lr"] and got["loss"] == pytest.approx(want["loss"], abs=1e-6)


def _compiled_layers(backend) -> list[bool]:
    # nn.Module.compile() keeps the module (and its parameter names) and sets its compiled call
    return [getattr(layer, "_compiled_call_impl", None) is not None
            for chunk in backend.actor.chunks for layer in chunk.decoder.layers]


@pytest.mark.slow
def test_compiled_head_and_layers_give_the_eager_logprobs_and_step(tiny_dense, backend_factory) -> None:
    """``megatron.compile``: the log-prob head's maths and (``compile_layers``, by default the same)
    every transformer layer through torch.compile, same numbers; with the layers left eager the
    rotary embedding is compiled alone."""
    from miles_megatron import rope
    from miles_megatron.head import compile_kernel

    batch = make_test_batch(tiny_dense)
    results = []
    # compiled functions: the head's three per-chunk ones and the rotary embedding (which a compiled
    # layer traces as plain code instead)
    for options, kernels, layers in (({"compile": False}, 0, False), ({"compile": True}, 4, True),
                                     ({"compile": True, "compile_layers": False}, 4, False)):
        compile_kernel.cache_clear()
        backend = backend_factory(tiny_dense, megatron=options)
        assert _compiled_layers(backend) == [layers] * 2
        cores = [layer.self_attention.core_attention for chunk in backend.actor.chunks for layer in chunk.decoder.layers]
        assert all((core.apply_rope is rope.apply) == (layers or not options["compile"]) for core in cores)
        old = backend.compute_logprobs(batch)
        step = replace(batch, advantages=torch.where(batch.loss_mask > 0, 1.0, 0.0), old_logprobs=old, rollout_logprobs=old)
        results.append((old, backend.train_step(step)))
        assert compile_kernel.cache_info().currsize == kernels
        backend.close()
    (eager, eager_metrics), *compiled = results
    for logprobs, metrics in compiled:
        torch.testing.assert_close(logprobs, eager, rtol=1e-5, atol=1e-5)
        for key in ("loss", "grad_norm", "entropy"):
            assert metrics[key] == pytest.approx(eager_metrics[key], rel=1e-4, abs=1e-6), key


def test_moe_layers_and_recomputed_layers_stay_eager(tiny_moe, tiny_dense, backend_factory) -> None:
    """Compiled layers skip MoE layers (data-dependent token routing) and recomputation (layer
    pieces run under megatron-core's checkpoint function)."""
    assert _compiled_layers(backend_factory(tiny_moe, megatron={"compile_layers": True})) == [False, False]
    recomputed = backend_factory(tiny_dense, megatron={"compile_layers": True, "recompute": "selective"})
    assert _compiled_layers(recomputed) == [False, False]


def test_cuda_turns_on_megatron_core_s_swiglu_and_bias_dropout_add_fusions(tiny_dense) -> None:
    """On a GPU (the config only is built here): megatron-core's fused SwiGLU and bias-dropout-add;
    not its fused GeGLU (a tanh approximation), and neither on the CPU."""
    import torch.nn.functional as F
    from miles_megatron.config import MegatronSection
    from miles_megatron.model import transformer_config
    from miles_megatron.parallel import Layout

    hf = json.loads((tiny_dense / "config.json").read_text())
    base = Kernel.load().model_bridge(hf).megatron_config(hf)
    layout = Layout(tp=1, pp=1, cp=1, ep=1, vpp=None, dp=1)

    def fusions(device: str, activation) -> tuple[bool, bool]:
        megatron = {**base, "transformer_config": {**base["transformer_config"], "activation_func": activation}}
        tc = transformer_config(megatron, MegatronSection(), layout, dtype=torch.bfloat16, device=torch.device(device),
                                transformer_engine=False, recompute="none")
        return tc.bias_activation_fusion, tc.bias_dropout_fusion

    assert fusions("cuda", F.silu) == (True, True)
    assert fusions("cuda", F.gelu) == (False, True)
    assert fusions("cpu", F.silu) == (False, False)


def test_transformer_engine_gets_its_fused_rotary_embedding(tiny_dense, monkeypatch) -> None:
    """With Transformer Engine (config only: it is not installed here, so megatron-core's check for
    its fused rotary kernels is given a stand-in) the rotary embedding of packed sequences is fused;
    the local layers keep it off (miles_megatron.rope applies it instead)."""
    from megatron.core.models.common.embeddings import rope_utils
    from miles_megatron.config import MegatronSection
    from miles_megatron.model import transformer_config
    from miles_megatron.parallel import Layout

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", lambda *a, **k: None)
    hf = json.loads((tiny_dense / "config.json").read_text())
    megatron = Kernel.load().model_bridge(hf).megatron_config(hf)
    layout = Layout(tp=1, pp=1, cp=1, ep=1, vpp=None, dp=1)
    for engine in (True, False):
        tc = transformer_config(megatron, MegatronSection(), layout, dtype=torch.bfloat16, device=torch.device("cuda"),
                                transformer_engine=engine, recompute="none")
        assert tc.apply_rope_fusion is engine


def test_a_cpu_model_on_a_host_with_a_gpu_is_a_clear_error(tiny_dense, backend_factory, monkeypatch) -> None:
    from miles_megatron import cpu_shim

    monkeypatch.setattr(cpu_shim, "needed", lambda: False)  # what it says on a host with CUDA
    with pytest.raises(ValueError, match="only on a host without a usable GPU"):
        backend_factory(tiny_dense)
    monkeypatch.undo()
    assert backend_factory(tiny_dense).actor is not None  # nothing was left half set up


def test_sdpa_preference_picks_the_attention_kernels(tiny_dense, backend_factory) -> None:
    """``megatron.sdpa_backends`` picks the local layers' attention kernels: math-only gives the
    default's step, and a kernel this CPU lacks makes attention fail (so the preference is really
    applied). The context is entered inside core attention's forward, so a recomputed forward holds
    it too; recomputation itself cannot run here (megatron-core's checkpoint needs CUDA's RNG)."""
    batch = make_test_batch(tiny_dense)
    metrics = []
    for options in ({}, {"sdpa_backends": ["math"]}):
        backend = backend_factory(tiny_dense, megatron=options)
        old = backend.compute_logprobs(batch)
        advantages = torch.where(batch.loss_mask > 0, torch.ones_like(old), torch.zeros_like(old))
        metrics.append(backend.train_step(replace(batch, advantages=advantages, old_logprobs=old, rollout_logprobs=old)))
    for key in ("loss", "grad_norm"):
        assert metrics[1][key] == pytest.approx(metrics[0][key], rel=1e-5), key

    refused = backend_factory(tiny_dense, megatron={"sdpa_backends": ["cudnn"]})
    with pytest.raises(RuntimeError, match="(?i)no (available kernel|viable backend)"):
        refused.compute_logprobs(batch)


def test_transformer_engine_without_its_torch_extension_counts_as_absent(tmp_path, monkeypatch) -> None:
    """The core package imports without the PyTorch extension (built separately, scripts/h200/te.sh);
    ``auto`` must then take the local layers, and an explicit ``transformer_engine`` say why not."""
    from miles_megatron.spec import transformer_engine_available, use_transformer_engine

    package = tmp_path / "transformer_engine"
    (package / "pytorch").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    # what TE's loader does when the extension's .so is missing or its versions disagree
    (package / "pytorch" / "__init__.py").write_text("raise AssertionError('Could not find `transformer-engine`.')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("transformer_engine", "transformer_engine.pytorch"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        assert not transformer_engine_available()
        assert not use_transformer_engine("auto", torch.device("cuda"))
        with pytest.raises(RuntimeError, match="does not import"):
            use_transformer_engine("transformer_engine", torch.device("cuda"))
    finally:
        # the stand-in package must not outlive the test: megatron-core modules imported later
        # would take it for Transformer Engine
        for name in [n for n in sys.modules if n == "transformer_engine" or n.startswith("transformer_engine.")]:
            del sys.modules[name]
