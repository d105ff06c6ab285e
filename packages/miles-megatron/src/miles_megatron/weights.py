"""Weights between HF checkpoints and this rank's megatron-core shards, through the model bridge.

In: the bridge converts the HF tensors to megatron-core tensors (its names: the Transformer
Engine spec's); each rank copies into every parameter it holds that parameter's slice: its
pipeline stage's layers (renumbered from global to chunk-local), its experts (from global to
local index), its tensor-parallel shard along the parameter's ``partition_dim``. A gated MLP's
``linear_fc1`` holds ``[gate; up]`` and each rank keeps its share of *both* halves.

Out (:class:`WeightGather`): collective. Every rank walks the same list of tensors; for each, the
ranks holding its shards (one data-parallel replica) send them to rank 0, which joins them,
drops vocabulary padding and, once a decoder layer is complete, converts it to HF names through
the bridge and yields it. Other ranks yield nothing (rank 0's tensors are what a transport
pushes). Memory on rank 0 stays around one decoder layer when the bridge converts layer by layer.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from miles.trainer.collectives import all_gather_json
from miles_contracts.bridges import takes_partial

from miles_megatron.spec import local_name

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
_VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(slots=True)
class Shard:
    """One parameter of this rank and where it sits in the full model.

    :ivar name: the bridge's (global) megatron name of the full tensor.
    :ivar dim: tensor-parallel partition dimension, or None when replicated.
    :ivar tp_size / tp_rank: over the tensor-parallel (or expert-tensor-parallel) group.
    :ivar glu: a gated ``linear_fc1`` (``[gate; up]``, each half sharded separately).
    :ivar representative: this rank's copy is the one gathered (data-parallel replica 0).
    """

    param: torch.Tensor
    name: str
    dim: int | None
    tp_size: int
    tp_rank: int
    glu: bool
    representative: bool

    def slice_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor."""
        if self.dim is None or self.tp_size == 1:
            return full
        if self.glu:
            return torch.cat([half.chunk(self.tp_size, self.dim)[self.tp_rank] for half in full.chunk(2, self.dim)], self.dim)
        return full.chunk(self.tp_size, self.dim)[self.tp_rank]


def join_shards(parts: list[torch.Tensor], dim: int | None, glu: bool) -> torch.Tensor:
    """Inverse of :meth:`Shard.slice_of` over all tensor-parallel ranks (``parts`` in rank order)."""
    if dim is None or len(parts) == 1:
        return parts[0]
    if glu:
        halves = [p.chunk(2, dim) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves], dim), torch.cat([h[1] for h in halves], dim)], dim)
    return torch.cat(parts, dim)


def _global_name(local: str, layer_offset: int, expert_offset: int) -> str:
    name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", local)
    return _EXPERT.sub(lambda m: f".local_experts.{int(m.group(1)) + expert_offset}.", name)


def describe_shards(chunks: list[Any], config: Any, bridge_names: list[str]) -> list[Shard]:
    """Every parameter of this rank's chunks, with its bridge name and sharding."""
    from megatron.core import parallel_state as ps

    by_local = {local_name(n): n for n in bridge_names}
    dense_rep = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    expert_rep = ps.get_expert_data_parallel_rank() == 0
    experts_per_rank = (config.num_moe_experts or 0) // config.expert_model_parallel_size
    expert_offset = ps.get_expert_model_parallel_rank() * experts_per_rank
    shards, unknown = [], []
    for chunk in chunks:
        layers = chunk.decoder.layers
        layer_offset = layers[0].layer_number - 1 if len(layers) else 0
        for local, param in chunk.named_parameters():
            is_expert = ".mlp.experts." in local
            name = _global_name(local, layer_offset, expert_offset if is_expert else 0)
            tied_copy = local == "output_layer.weight" and name not in by_local.values() and chunk.share_embeddings_and_output_weights
            if tied_copy:
                name = "embedding.word_embeddings.weight"
            bridge = by_local.get(name, name if name in bridge_names else None)
            if bridge is None:
                unknown.append(local)
                continue
            sharded = getattr(param, "tensor_model_parallel", False)
            tp_size = ps.get_expert_tensor_parallel_world_size() if is_expert else ps.get_tensor_model_parallel_world_size()
            tp_rank = ps.get_expert_tensor_parallel_rank() if is_expert else ps.get_tensor_model_parallel_rank()
            shards.append(Shard(
                param=param, name=bridge, dim=param.partition_dim if sharded else None, tp_size=tp_size, tp_rank=tp_rank,
                glu=bool(config.gated_linear_unit) and ".linear_fc1." in local,
                representative=(expert_rep if is_expert else dense_rep) and not tied_copy,
            ))
    if unknown:
        raise ValueError(f"the bridge's megatron tensors do not cover these model parameters: {', '.join(unknown[:8])}; "
                         f"check that the bridge's layer spec matches the model's")
    return shards


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] >= rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])


def load_into(shards: list[Shard], mcore: Mapping[str, torch.Tensor], padded_vocab: int) -> None:
    """Copy each shard's slice of the bridge's full tensors into this rank's parameters."""
    with torch.no_grad():
        for shard in shards:
            full = mcore[shard.name]
            if shard.name in _VOCAB_ROWS:
                full = _pad_rows(full, padded_vocab)
            part = shard.slice_of(full)
            if tuple(part.shape) != tuple(shard.param.shape):
                raise ValueError(f"{shard.name}: this rank's slice is {tuple(part.shape)} but the parameter is "
                                 f"{tuple(shard.param.shape)}; the bridge's megatron_config and tensors disagree")
            shard.param.copy_(part)


class WeightGather:
    """Full HF tensors on rank 0 from every rank's shards (see the module docstring).

    The plan (which rank holds which shard) is exchanged once, on the first gather.
    """

    def __init__(self, shards: list[Shard], bridge_names: list[str], bridge: Any, hf_config: Mapping[str, Any],
                 vocab_size: int) -> None:
        self.shards = {(s.name, s.tp_rank): s for s in shards if s.representative}
        self.order = bridge_names
        self.bridge, self.hf_config, self.vocab_size = bridge, hf_config, vocab_size
        self.partial = takes_partial(bridge.to_hf)
        # every parameter has the model's dtype (a rank without representative shards never receives)
        self.param_dtype = shards[0].param.dtype if shards else torch.float32
        self._plan: dict[str, list[tuple[int, int, tuple[int, ...], int | None, bool]]] | None = None

    def _exchange_plan(self) -> dict[str, list[tuple[int, int, tuple[int, ...], int | None, bool]]]:
        mine = [(s.name, s.tp_rank, list(s.param.shape), s.dim, s.glu) for s in self.shards.values()]
        plan: dict[str, list[tuple[int, int, tuple[int, ...], int | None, bool]]] = {}
        for owner, entries in enumerate(all_gather_json(mine)):
            for name, tp_rank, shape, dim, glu in entries:
                plan.setdefault(name, []).append((tp_rank, owner, tuple(shape), dim, glu))
        missing = [n for n in self.order if n not in plan]
        if missing:
            raise RuntimeError(f"no rank holds {', '.join(missing[:8])}: the model does not cover the bridge's tensors")
        return {name: sorted(parts) for name, parts in plan.items()}

    def _full(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The full megatron tensor on rank 0 (None elsewhere); sending ranks send their shard."""
        assert self._plan is not None, "gather exchanges the plan first"
        entries = self._plan[name]
        rank = dist.get_rank()
        parts = []
        for tp_rank, owner, shape, _dim, _glu in entries:
            if owner == rank:
                local = self.shards[(name, tp_rank)].param.detach()
                if rank == 0:
                    parts.append(local)
                else:
                    dist.send(local.contiguous(), dst=0)
            elif rank == 0:
                buffer = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(buffer, src=owner)
                parts.append(buffer)
        if rank != 0:
            return None
        _, _, _, dim, glu = entries[0]
        full = join_shards(parts, dim, glu)
        if name in _VOCAB_ROWS:
            full = full[: self.vocab_size]
        return full

    def gather(self, dtype: torch.dtype | None, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` on rank 0, one decoder layer at a time; nothing on other ranks."""
        if self._plan is None:
            self._plan = self._exchange_plan()
        group: dict[str, torch.Tensor] = {}
        key = None
        for name in self.order:
            layer = _LAYER.match(name)
            this_key = layer.group(0) if layer else name
            if group and this_key != key and self.partial:
                yield from self._convert(group, dtype)
                group = {}
            key = this_key
            full = self._full(name, self.param_dtype, device)
            if full is not None:
                group[name] = full
        if group:
            yield from self._convert(group, dtype)

    def _convert(self, group: dict[str, torch.Tensor], dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
        if dist.get_rank() != 0:
            return
        hf = self.bridge.to_hf(group, self.hf_config, partial=True) if self.partial else self.bridge.to_hf(group, self.hf_config)
        for name, tensor in hf.items():
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            yield name, tensor.contiguous()
