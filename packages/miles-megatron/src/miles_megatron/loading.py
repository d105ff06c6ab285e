"""Weights in: an HF checkpoint into this rank's megatron parameters, through the model bridge.

A bridge whose ``to_megatron`` takes ``partial=True`` is fed one decoder layer at a time
(:class:`StreamedWeights`): each rank reads only the layers that hold one of its parameters
(a pipeline stage reads its own layers), and holds one layer's HF and megatron tensors at a time.
Before, every rank read the whole checkpoint and converted all of it: two copies of the model in
host memory per rank, eight per node at TP=8 (a 70B model in bf16: over 2 TB).

The names and shapes come first, from the safetensors headers: the bridge converts meta tensors
(no weight is read), which also checks the checkpoint against the bridge's mapping as a whole, so
a missing or unexpected tensor is still reported up front, every name at once.

A bridge without the keyword gets the whole state in one call (:class:`WholeWeights`), as do
weights handed over in memory (benchmarks).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from miles_contracts.bridges import decoder_layer, takes_partial

from miles_megatron.weights import Shard, load_into

# safetensors' dtype codes (the header's "dtype") and torch's
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class Checkpoint:
    """The ``*.safetensors`` files of a model folder, read lazily: names, shapes and dtypes from
    the headers (:attr:`meta`), tensors when asked (:meth:`read`)."""

    def __init__(self, model_dir: Path) -> None:
        from safetensors import safe_open

        self.files = sorted(Path(model_dir).glob("*.safetensors"))
        if not self.files:
            raise FileNotFoundError(f"{model_dir} holds no *.safetensors file; the megatron backend loads safetensors "
                                    f"checkpoints")
        self.where: dict[str, Path] = {}
        self.meta: dict[str, torch.Tensor] = {}
        for file in self.files:
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 -- a safetensors handle, not a dict
                    part = handle.get_slice(name)
                    code = part.get_dtype()
                    if code not in _DTYPES:
                        raise ValueError(f"{file.name}: tensor {name} has dtype {code}, which the megatron backend "
                                         f"does not load (known: {', '.join(_DTYPES)})")
                    self.meta[name] = torch.empty(part.get_shape(), dtype=_DTYPES[code], device="meta")
                    self.where[name] = file

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.where[name], []).append(name)
        out = {}
        for file, wanted in by_file.items():
            with safe_open(file, framework="pt") as handle:
                for name in wanted:
                    out[name] = handle.get_tensor(name)
        return out

    def groups(self) -> list[tuple[int | None, list[str]]]:
        """``(layer, names)`` by decoder layer (``.layers.<i>.``), the rest (embeddings, final norm,
        output layer; layer None) first: the units a bridge converts on their own."""
        layers: dict[int, list[str]] = {}
        rest = []
        for name in self.meta:
            layer = decoder_layer(name)
            if layer is None:
                rest.append(name)
            else:
                layers.setdefault(layer, []).append(name)
        return [(None, rest), *((i, layers[i]) for i in sorted(layers))]


class WholeWeights:
    """The whole HF state converted in one call (kept until :meth:`release`)."""

    layers_read = None  # not streamed

    def __init__(self, bridge: Any, hf_state: Mapping[str, torch.Tensor], hf_config: Mapping[str, Any]) -> None:
        self.mcore: dict[str, torch.Tensor] | None = bridge.to_megatron(hf_state, hf_config)
        self.names = list(self.mcore)

    def load(self, shards: list[Shard], padded_vocab: int) -> None:
        assert self.mcore is not None, "released"
        load_into(shards, self.mcore, padded_vocab)

    def release(self) -> None:
        self.mcore = None


class StreamedWeights:
    """A checkpoint converted one layer at a time, only the layers this rank's parameters need."""

    def __init__(self, bridge: Any, checkpoint: Checkpoint, hf_config: Mapping[str, Any]) -> None:
        self.bridge, self.checkpoint, self.hf_config = bridge, checkpoint, hf_config
        self.names = list(bridge.to_megatron(checkpoint.meta, hf_config))  # the whole mapping checked, nothing read
        self.layers_read: list[int | None] = []  # what the last load read (None: the non-layer tensors)

    def load(self, shards: list[Shard], padded_vocab: int) -> None:
        needed = {s.name for s in shards}
        loaded: set[str] = set()
        self.layers_read = []
        for layer, group in self.checkpoint.groups():
            made = self.bridge.to_megatron({n: self.checkpoint.meta[n] for n in group}, self.hf_config, partial=True)
            if not needed & made.keys():
                continue  # another pipeline stage's layer
            mcore = self.bridge.to_megatron(self.checkpoint.read(group), self.hf_config, partial=True)
            load_into([s for s in shards if s.name in mcore], mcore, padded_vocab)
            loaded |= mcore.keys()
            self.layers_read.append(layer)
        missing = sorted(needed - loaded)
        if missing:
            raise ValueError(f"the bridge made no tensor for {', '.join(missing[:8])} from any one decoder layer's "
                             f"checkpoint tensors (a mapping rule that reads several layers cannot stream); "
                             f"the bridge's to_megatron(partial=True) must map each layer on its own")

    def release(self) -> None:
        pass


def weight_source(bridge: Any, hf_config: Mapping[str, Any], *, model_dir: Path | None = None,
                  hf_state: Mapping[str, torch.Tensor] | None = None) -> WholeWeights | StreamedWeights:
    """Where this rank's starting weights come from: ``hf_state`` in memory, else ``model_dir``'s
    checkpoint (streamed when the bridge converts in parts)."""
    if hf_state is not None:
        return WholeWeights(bridge, hf_state, hf_config)
    assert model_dir is not None
    checkpoint = Checkpoint(model_dir)
    if takes_partial(bridge.to_megatron):
        return StreamedWeights(bridge, checkpoint, hf_config)
    return WholeWeights(bridge, checkpoint.read(checkpoint.meta), hf_config)
