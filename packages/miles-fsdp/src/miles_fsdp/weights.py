"""Full HF-named weights out of FSDP shards: for weight transport and for ``export_hf``.

Weights are gathered one tensor at a time, in the module's own order (embeddings, then layer by
layer, then the head), so a transport can fill and flush buckets while the next layer is being
gathered and no rank ever holds the whole model twice. Gathering is collective: every rank must
iterate to the end, in the same order.

Names and shapes are the *checkpoint's*: transformers converts some weights when it loads them
(a Qwen3-MoE layer's per-expert ``experts.<e>.gate_proj.weight`` become one fused 3-D
``experts.gate_up_proj``), and engines load checkpoint names, so each layer's tensors go through
transformers' own reverse conversion before they are yielded. A tied output head is yielded once,
under the input embedding's name, as HF checkpoints store it.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from miles_fsdp.distributed import DistContext, barrier

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_LAYER = re.compile(r"^(.*\.layers\.\d+\.)")
SHARD_BYTES = 4 * 1024**3  # safetensors file size of an export, as HF writes them
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def _runtime_weights(hf: nn.Module, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(runtime_name, full tensor)`` of every parameter and persistent buffer (collective)."""
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    for name, tensor in hf.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # tied weights appear under two names
            continue
        seen.add(id(tensor))
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        full = full.detach()
        if dtype is not None and full.is_floating_point():
            full = full.to(dtype)
        yield name, full


def _to_checkpoint_format(hf: PreTrainedModel, group: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Undo transformers' load-time weight conversions (e.g. per-expert MoE weights fused into one
    3-D tensor) so names and shapes are the checkpoint's, which engines load."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers without load-time conversions: runtime names are checkpoint names
        return group
    return revert_weight_conversion(hf, group)


def _group_key(name: str) -> str:
    """Tensors of one decoder layer are converted together (a conversion may span several)."""
    match = _LAYER.match(name)
    return match.group(1) if match else name


def gather_named_weights(hf: PreTrainedModel, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` in checkpoint format, one decoder layer at a time (collective)."""
    group: dict[str, torch.Tensor] = {}
    key = None
    for name, tensor in _runtime_weights(hf, dtype):
        if group and _group_key(name) != key:
            yield from ((n, t.contiguous()) for n, t in _to_checkpoint_format(hf, group).items())
            group = {}
        key = _group_key(name)
        group[name] = tensor
    if group:
        yield from ((n, t.contiguous()) for n, t in _to_checkpoint_format(hf, group).items())


def _config_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def export_hf(hf: PreTrainedModel, path: Path, *, source_dir: Path | None, dtype: torch.dtype, dist_ctx: DistContext,
              weights: Iterator[tuple[str, torch.Tensor]] | None = None) -> None:
    """Write ``hf`` as an HF checkpoint folder loadable by ``AutoModelForCausalLM.from_pretrained``.

    Collective (every rank gathers); rank 0 writes: safetensors shards (with an index when more
    than one), ``config.json`` with the exported dtype, and every non-weight file of ``source_dir``
    (tokenizer, chat template, generation config). ``weights``: what to write instead of the
    gathered weights of ``hf`` (e.g. with LoRA adapters merged in); same collective contract.
    """
    from safetensors.torch import save_file

    path = Path(path)
    if dist_ctx.is_main:
        path.mkdir(parents=True, exist_ok=True)
        for old in path.iterdir():
            if old.name.endswith(_WEIGHT_SUFFIXES):
                old.unlink()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in weights if weights is not None else gather_named_weights(hf, dtype):
        if not dist_ctx.is_main:
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.cpu().contiguous()
        size += nbytes
    if dist_ctx.is_main:
        _write_shards(path, shards, save_file)
        if source_dir is not None:
            for item in Path(source_dir).iterdir():
                if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES) and item.name != "config.json":
                    shutil.copy2(item, path / item.name)
        config = hf.config.to_dict()
        config["dtype"] = _config_dtype_name(dtype)
        (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    barrier()


def _write_shards(path: Path, shards: list[dict[str, torch.Tensor]], save_file) -> None:
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata=metadata)
        return
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / filename), metadata=metadata)
        for name, tensor in shard.items():
            weight_map[name] = filename
            total += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
