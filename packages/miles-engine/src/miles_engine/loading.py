"""Load the model and tokenizer an engine serves; resolve ``auto`` device and dtype."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles_engine import attention
from miles_engine.config import EngineConfig

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


@dataclass(slots=True)
class LoadedModel:
    """A causal LM in eval mode, its tokenizer, and facts the scheduler needs."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    vocab_size: int  # rows of the input embedding: valid token ids are [0, vocab_size)
    context_length: int
    eos_token_ids: frozenset[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int


def resolve_device(device: str) -> torch.device:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but torch sees no CUDA device; use --device cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return getattr(torch, _DTYPES[dtype])


def load_model(config: EngineConfig) -> LoadedModel:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from miles_engine import invariant

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path or config.model_path)
    # CPU decode attention is faster as two batched matmuls than through SDPA (see attention.py).
    per_row = config.enable_deterministic_inference
    attn = attention.register(per_row=per_row) if device.type == "cpu" else "sdpa"
    if config.true_on_policy:
        invariant.check_supported(device, dtype)
        attn = invariant.register()
    model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=dtype, attn_implementation=attn)
    if config.lora is not None:  # before moving: the adapters are created next to the base weights
        from miles_engine.lora import attach_lora

        attach_lora(model, config.lora)
    model.to(device)  # type: ignore[arg-type]  # transformers' @wraps(nn.Module.to) hides the real signature
    if config.true_on_policy:
        invariant.install_linears(model)
    model.eval()
    model.requires_grad_(False)
    hf = model.config.get_text_config()
    num_heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    model_max = getattr(hf, "max_position_embeddings", None) or 4096
    context = config.context_length or model_max
    if context > model_max:
        raise ValueError(f"context_length {context} exceeds the model's max_position_embeddings {model_max}")
    embedding = model.get_input_embeddings().weight
    assert isinstance(embedding, torch.Tensor)  # a Parameter (nn.Module types attributes as Tensor | Module)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        vocab_size=embedding.shape[0],
        context_length=context,
        eos_token_ids=_eos_ids(model, tokenizer),
        num_layers=hf.num_hidden_layers,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
    )


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
