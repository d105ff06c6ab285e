"""Models for ``miles bench weights``: the trainer's tensors of a model folder, and larger
random-weight Llama models built once from SmolLM2's config and tokenizer."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from miles_contracts import LoRASpec


@dataclass(frozen=True, slots=True)
class LlamaShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int


RANDOM_MODELS = {
    # Qwen3-0.6B's layer sizes as a Llama (its head_dim is 128, here hidden / heads = 64: q/o are half as wide)
    "0.6b": LlamaShape(hidden=1024, intermediate=3072, layers=28, heads=16, kv_heads=8),
    "1b": LlamaShape(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8),   # ~1.1 B params
    "8b": LlamaShape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8),  # ~7.5 B params
}
_SHARD_BYTES = 2 << 30


def load_tensors(model_dir: Path, dtype: torch.dtype, device: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the folder's safetensors files, as HF names, in ``dtype`` on ``device``."""
    from safetensors import safe_open

    out = []
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                out.append((name, handle.get_tensor(name).to(dtype=dtype, device=device).contiguous()))
    if not out:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return out


def adapter_tensors(full: list[tuple[str, torch.Tensor]], spec: LoRASpec) -> list[tuple[str, torch.Tensor]]:
    """Random LoRA adapters (``lora_A [r, in]``, ``lora_B [out, r]``) for every 2-D weight of
    ``full`` whose module is one of ``spec.target_modules``: what a ``train.lora`` run syncs."""
    import torch

    generator = torch.Generator().manual_seed(1)
    out = []
    for name, tensor in full:
        module = name.removesuffix(".weight")
        if tensor.dim() != 2 or module == name or module.rpartition(".")[2] not in spec.target_modules:
            continue
        rows, cols = tensor.shape
        for suffix, dims in (("lora_A", (spec.rank, cols)), ("lora_B", (rows, spec.rank))):
            random = torch.randn(dims, generator=generator) * 0.02
            out.append((f"{module}.{suffix}.weight", random.to(dtype=tensor.dtype, device=tensor.device)))
    return out


def _llama_tensors(shape: LlamaShape, vocab: int) -> list[tuple[str, list[int]]]:
    head_dim = shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim
    names: list[tuple[str, list[int]]] = [("model.embed_tokens.weight", [vocab, shape.hidden])]
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        names += [
            (f"{p}.input_layernorm.weight", [shape.hidden]),
            (f"{p}.self_attn.q_proj.weight", [shape.hidden, shape.hidden]),
            (f"{p}.self_attn.k_proj.weight", [kv, shape.hidden]),
            (f"{p}.self_attn.v_proj.weight", [kv, shape.hidden]),
            (f"{p}.self_attn.o_proj.weight", [shape.hidden, shape.hidden]),
            (f"{p}.post_attention_layernorm.weight", [shape.hidden]),
            (f"{p}.mlp.gate_proj.weight", [shape.intermediate, shape.hidden]),
            (f"{p}.mlp.up_proj.weight", [shape.intermediate, shape.hidden]),
            (f"{p}.mlp.down_proj.weight", [shape.hidden, shape.intermediate]),
        ]
    return names + [("model.norm.weight", [shape.hidden])]


def random_llama(size: str | LlamaShape, base_dir: Path, cache_dir: Path, *, seed: int = 0) -> Path:
    """A Llama of ``size`` (a key of :data:`RANDOM_MODELS`, or any shape) with random bf16 weights
    and the config (tied embeddings included) and tokenizer of ``base_dir``; written once under
    ``cache_dir`` and reused."""
    import torch
    from safetensors.torch import save_file

    shape = RANDOM_MODELS[size] if isinstance(size, str) else size
    label = size if isinstance(size, str) else (f"h{shape.hidden}-i{shape.intermediate}-l{shape.layers}"
                                                 f"-a{shape.heads}-kv{shape.kv_heads}")
    final = cache_dir / f"random-llama-{label}-s{seed}"
    if (final / "model.safetensors.index.json").is_file():
        return final
    partial = cache_dir / f".{final.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    config = json.loads((base_dir / "config.json").read_text())
    config.update(hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                  num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                  head_dim=shape.hidden // shape.heads, dtype="bfloat16")
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    for extra in base_dir.iterdir():
        if extra.suffix != ".safetensors" and extra.name not in ("config.json", "miles-model.json") and extra.is_file():
            shutil.copy2(extra, partial / extra.name)
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, index = 0, 1

    def flush() -> None:
        nonlocal shard, shard_bytes, index
        file = f"model-{index:05d}.safetensors"
        save_file(shard, str(partial / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        shard, shard_bytes, index = {}, 0, index + 1

    for name, dims in _llama_tensors(shape, int(config["vocab_size"])):
        if name.endswith("norm.weight"):
            tensor = torch.ones(dims, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(dims, generator=generator) * 0.02).to(torch.bfloat16)
        shard[name] = tensor
        shard_bytes += tensor.numel() * 2
        if shard_bytes >= _SHARD_BYTES:
            flush()
    if shard:
        flush()
    (partial / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    partial.rename(final)
    return final
