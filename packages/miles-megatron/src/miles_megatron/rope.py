"""Rotary embeddings of the local layers, applied inside core attention from each token's position.

megatron-core's unfused rotary embedding of packed (THD) sequences does, per layer and for
queries and keys apart: read the sequence lengths back from the GPU (a device sync that stalls
the launch queue), slice each sequence's angles out of the table and concatenate them, and take
``cos``/``sin`` of the result again (``docs/design/megatron.md``, measured in
``docs/benchmarks/train.md``).

Every packed token already carries its position (``position_ids``: its index within its own row,
context-parallel chunks included), so one gather gives each token its angles: computed once per
micro-batch (:func:`angles`), turned into ``cos``/``sin`` once per dtype, and applied to the
whole packed query and key tensors in :func:`apply` (the same arithmetic as megatron-core's
unfused path, in the same dtype, so the results are bit-identical in eager mode).

The model is told by :func:`defer`: ``GPTModel`` then skips its own rotary step (its
``position_embedding_type`` is set to :data:`DEFERRED`, the only place it reads it after
construction), keeps its ``RotaryEmbedding`` module (the angles, with any frequency scaling the
bridge configured), and every layer's :class:`~miles_megatron.attention.TorchAttention` applies the
embedding to the inputs it receives. Interleaved and multi-latent rotary layouts stay with
megatron-core.
"""

from __future__ import annotations

from typing import Any

import torch

DEFERRED = "rope (applied by miles_megatron.attention)"


def defer(model: Any, *, compiled: bool = False) -> bool:
    """Move ``model``'s rotary embedding into its layers' core attention; whether it did.

    :param compiled: apply it through ``torch.compile`` (one fused kernel for queries or keys).
    """
    from megatron.core.transformer.attention import _yarn_get_concentration_factor_from_config

    from miles_megatron.attention import TorchAttention
    from miles_megatron.head import compile_kernel

    config = model.config
    if model.position_embedding_type != "rope" or config.multi_latent_attention or config.rotary_interleaved:
        return False
    if _yarn_get_concentration_factor_from_config(config) != 1.0:
        return False  # a scaled rotation (YaRN's mscale) stays with megatron-core
    cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
    if not all(isinstance(core, TorchAttention) for core in cores):
        return False
    model.position_embedding_type = DEFERRED
    for core in cores:
        core.apply_rope = compile_kernel(apply) if compiled else apply
    return True


def deferred(model: Any) -> bool:
    return getattr(model, "position_embedding_type", None) == DEFERRED


def angles(model: Any, position_ids: torch.Tensor, max_seqlen: int) -> torch.Tensor | None:
    """``[n, rotary_dim]`` fp32 rotary angles of this rank's ``n`` tokens (``position_ids [1, n]``),
    or ``None`` when ``model`` applies rotary embeddings itself."""
    if not deferred(model):
        return None
    # [max_seqlen, 1, 1, rotary_dim]: every position of the longest row, frequency scaling included
    table = model.rotary_pos_emb(max_seqlen, packed_seq=True)
    # the table is where megatron-core made it (its current CUDA device on a GPU host)
    return table.view(table.shape[0], -1).to(position_ids.device).index_select(0, position_ids.reshape(-1))


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [n, heads, d]`` by ``cos, sin [n, 1, rotary_dim]`` (``rotary_dim <= d``; the rest passes)."""
    width = cos.shape[-1]
    rotating, passing = x[..., :width], x[..., width:]
    first, second = torch.chunk(rotating, 2, dim=-1)
    out = rotating * cos + torch.cat((-second, first), dim=-1) * sin
    return out if passing.shape[-1] == 0 else torch.cat((out, passing), dim=-1)


def tables(params: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [n, 1, rotary_dim]`` in ``dtype`` of a micro-batch's packed-sequence ``params``
    (made once per dtype and kept on them: every layer of the micro-batch reuses them)."""
    freqs = getattr(params, "rope_angles", None)
    if freqs is None:
        raise ValueError("this model's rotary embedding is applied by TorchAttention, but the packed-sequence "
                         "parameters carry no rotary angles; build them with MicroInputs.packed_seq_params(rope_angles=rope.angles(...))")
    cache = params.rope_tables
    if dtype not in cache:
        # cos/sin in fp32, then cast: what megatron-core's unfused path computes
        cache[dtype] = (freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :])
    return cache[dtype]
