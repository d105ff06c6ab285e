"""Rotary embeddings applied in core attention from each token's position (miles_megatron.rope)
give exactly what megatron-core's own per-sequence path gives, which then never runs."""

from __future__ import annotations

import pytest
import torch
from miles_contracts.testing.backend import make_test_batch


def _megatron_applies_rope(backend) -> None:
    """Undo :func:`miles_megatron.rope.defer` on every chunk: megatron-core's THD path again."""
    for chunk in backend.actor.chunks:
        chunk.position_embedding_type = "rope"
        for layer in chunk.decoder.layers:
            layer.self_attention.core_attention.apply_rope = None


def test_rope_in_core_attention_equals_megatron_core_s(tiny_dense, backend_factory, monkeypatch) -> None:
    import megatron.core.transformer.attention as attention
    from miles_megatron import rope

    backend = backend_factory(tiny_dense, megatron={"logprob_chunk_size": 5})
    assert all(rope.deferred(chunk) for chunk in backend.actor.chunks)
    batch = make_test_batch(tiny_dense)
    assert len(set(batch.attention_mask.sum(1).tolist())) > 1  # rows of different lengths, packed together

    real = attention.apply_rotary_pos_emb
    calls = []
    monkeypatch.setattr(attention, "apply_rotary_pos_emb", lambda *a, **k: calls.append(1) or real(*a, **k))
    ours = backend.compute_logprobs(batch)
    assert not calls  # applied once, by TorchAttention, not twice

    _megatron_applies_rope(backend)
    theirs = backend.compute_logprobs(batch)
    assert calls  # megatron-core's path did run this time
    assert torch.equal(ours, theirs)


def test_packed_params_without_angles_are_refused() -> None:
    from miles_megatron import rope
    from miles_megatron.inputs import build

    inputs = build(torch.arange(12).view(2, 6), torch.ones(2, 6), [6, 4], tp=1, cp=1, cp_rank=0, device=torch.device("cpu"))
    assert inputs.bounds == [0, 6, 10]
    with pytest.raises(ValueError, match="carry no rotary angles"):
        rope.tables(inputs.packed_seq_params(), torch.float32)
    angles = torch.rand(10, 4)
    params = inputs.packed_seq_params(rope_angles=angles)
    cos, sin = rope.tables(params, torch.bfloat16)
    assert cos.shape == (10, 1, 4) and cos.dtype == torch.bfloat16 and rope.tables(params, torch.bfloat16)[0] is cos


@pytest.mark.gpu
def test_on_cuda_the_compiled_default_matches_megatron_core_s_rope(tiny_dense, make_config) -> None:
    """On a GPU (bf16, ``megatron.compile`` on by default, fused SwiGLU / bias-dropout-add): the
    compiled rotary embedding gives megatron-core's eager log-probs within bf16 rounding."""
    from dataclasses import replace

    from miles.context import context_for
    from miles.sections import ModelSection
    from miles_contracts import Process
    from miles_megatron import rope
    from miles_megatron.backend import MegatronBackend

    config = replace(make_config(tiny_dense), model=ModelSection(name=str(tiny_dense), device="cuda"))
    backend = MegatronBackend(context_for(config, Process.trainer_rank(0)))
    try:
        assert backend.compiled and backend.actor.config.bias_activation_fusion and backend.actor.config.bias_dropout_fusion
        assert all(rope.deferred(chunk) for chunk in backend.actor.chunks)
        batch = make_test_batch(tiny_dense)
        ours = backend.compute_logprobs(batch)
        _megatron_applies_rope(backend)
        theirs = backend.compute_logprobs(batch)
        mask = batch.loss_mask > 0
        torch.testing.assert_close(ours[mask], theirs[mask], atol=0.05, rtol=0.02)
    finally:
        backend.close()
