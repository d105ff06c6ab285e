"""LoRA on megatron-core's tensor-parallel linears, under the HF/PEFT names the fsdp backend uses.

megatron-core fuses projections: ``linear_qkv`` holds q, k and v (interleaved by query group),
``linear_fc1`` holds ``[gate; up]``. An adapter belongs to one *HF* projection (``q_proj``,
``gate_proj``, ...), so a fused linear carries one adapter per projection it holds, each with
the shapes PEFT gives it (``A [r, in]``, ``B [out, r]`` of that projection), and the update of
the fused output is assembled in megatron's layout. The adapters live in a sibling module of the
linear (``linear_qkv`` -> ``lora_linear_qkv``) whose forward hook adds the update; the base
linear, its parameter names and its checkpoint entries are untouched.

Tensor parallelism (``tp`` ranks, ``x`` the layer input, ``u = A x`` the rank-``r`` code):

- **Column-parallel base** (``linear_qkv``, ``linear_fc1``; output rows split): ``A`` is
  replicated and ``B`` split by output rows like the base weight, so each rank makes its own
  rows of the update, ``B_local u``. ``dL/du`` is a sum over every rank's rows: ``u`` goes
  through ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward), so
  every rank's ``dA`` is the full one. With sequence parallelism ``x`` is this rank's slice of
  the sequence: ``u`` is computed on it and all-gathered along the sequence (reduce-scatter
  backward), so ``dA`` covers the local tokens only, and ``A`` is marked ``sequence_parallel``:
  megatron-core's ``finalize_model_grads`` sums such gradients over the TP group.
- **Row-parallel base** (``linear_proj``, ``linear_fc2``; input columns split, output summed):
  ``A`` is split by input columns like the base weight and ``B`` replicated. ``A_local x_local``
  is a partial sum of ``u``; it is all-reduced (``r`` numbers per token, identity backward)
  before ``B``, so the update is made once per rank, whole, and added after the base's own
  reduction. With sequence parallelism the base output is this rank's slice of the sequence:
  the update is made for every token and sliced the same way (all-gather backward), so ``dB``
  is computed from all tokens on every rank and needs no reduction.

Initialisation does not depend on the layout: each full ``A`` is drawn (Kaiming uniform, PEFT's
bound ``1/sqrt(in)``) from a generator seeded by the run seed and its HF name, then sliced; ``B``
starts at zero. A run at TP=2 therefore starts from the adapters a run at TP=1 starts from.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from miles_contracts.lora import LoRASpec

    from miles_megatron.weights import Shard

ADAPTER_KEY = "lora_linear_"  # attribute prefix of the adapter modules: their parameter and checkpoint keys contain it


@dataclass(frozen=True, slots=True)
class FusedLinear:
    """Where a megatron linear sits and which HF projections it holds.

    :ivar path: inside a decoder layer (``self_attention.linear_qkv``).
    :ivar hf_module: the HF parent of its projections inside ``model.layers.<i>`` (``self_attn``).
    :ivar projections: the HF projections in the order megatron stacks them.
    :ivar column: column-parallel (output split) rather than row-parallel (input split).
    """

    path: str
    hf_module: str
    projections: tuple[str, ...]
    column: bool


# the Llama / Qwen / Mistral layout every first-party bridge converts to and from
FUSED_LINEARS = (
    FusedLinear("self_attention.linear_qkv", "self_attn", ("q_proj", "k_proj", "v_proj"), column=True),
    FusedLinear("self_attention.linear_proj", "self_attn", ("o_proj",), column=False),
    FusedLinear("mlp.linear_fc1", "mlp", ("gate_proj", "up_proj"), column=True),
    FusedLinear("mlp.linear_fc2", "mlp", ("down_proj",), column=False),
)


def _seeded_a(seed: int, hf_name: str, rank: int, fan_in: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(hf_name.encode()))
    bound = 1.0 / fan_in ** 0.5  # kaiming_uniform_(a=sqrt(5)), as nn.Linear and PEFT initialise A
    return (torch.rand(rank, fan_in, generator=generator) * 2 - 1) * bound


class LinearAdapters(nn.Module):
    """The adapters of one fused linear (one ``A``/``B`` pair per targeted projection).

    ``out_sizes``: every projection's full output rows (zeros are added for untargeted ones);
    ``groups``: how many blocks the fused output interleaves its projections in (query groups of
    ``linear_qkv``; 1 for ``[gate; up]``), per rank.
    """

    def __init__(self, fused: FusedLinear, targets: list[str], *, layer_prefix: str, in_size: int,
                 out_sizes: dict[str, int], groups: int, spec: LoRASpec, seed: int, sequence_parallel: bool,
                 device: torch.device) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.fused, self.targets, self.groups = fused, targets, groups
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.sequence_parallel = sequence_parallel and self.tp > 1
        self.local_out = {p: out_sizes[p] // self.tp for p in fused.projections}
        self.scaling = spec.scaling
        self.dropout: nn.Module = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        self.adapter_enabled = True  # off: the base alone (the KL reference; miles_engine.lora.switched_off)
        self.hf_names: dict[str, str] = {}
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for projection in targets:
            hf = f"{layer_prefix}.{fused.hf_module}.{projection}"
            self.hf_names[projection] = hf
            full_a = _seeded_a(seed, f"{hf}.lora_A.weight", spec.rank, in_size)
            a = full_a if fused.column else full_a.chunk(self.tp, 1)[self.tp_rank]
            b_rows = self.local_out[projection] if fused.column else out_sizes[projection]
            self.lora_A[projection] = nn.Parameter(a.contiguous().to(device))
            self.lora_B[projection] = nn.Parameter(torch.zeros(b_rows, spec.rank, device=device))
            split, dim = (self.lora_B[projection], 0) if fused.column else (self.lora_A[projection], 1)
            set_tensor_model_parallel_attributes(split, is_parallel=True, dim=dim, stride=1)
            if fused.column and self.sequence_parallel:
                self.lora_A[projection].sequence_parallel = True  # dA from local tokens: summed over TP

    def split_dims(self) -> dict[str, int]:
        """State-dict key -> the dimension it is split along over TP (megatron checkpoints)."""
        if self.fused.column:
            return {f"lora_B.{p}": 0 for p in self.targets}
        return {f"lora_A.{p}": 1 for p in self.targets}

    def update(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``scaling * B A x`` in the layout of the base output."""
        from megatron.core import tensor_parallel as tp

        x = self._dropped(x)
        if not self.fused.column:
            (projection,) = self.targets
            code = tp.reduce_from_tensor_model_parallel_region(x @ self.lora_A[projection].to(x.dtype).t())
            delta = code @ self.lora_B[projection].to(x.dtype).t() * self.scaling
            return tp.scatter_to_sequence_parallel_region(delta) if self.sequence_parallel else delta
        blocks: list[torch.Tensor | None] = []
        lead: tuple[int, ...] = ()
        for projection in self.fused.projections:
            if projection not in self.targets:
                blocks.append(None)
                continue
            code = x @ self.lora_A[projection].to(x.dtype).t()
            if self.sequence_parallel:
                code = tp.gather_from_sequence_parallel_region(code, tensor_parallel_output_grad=True)
            elif self.tp > 1:
                code = tp.copy_to_tensor_model_parallel_region(code)
            part = code @ self.lora_B[projection].to(x.dtype).t() * self.scaling
            lead = tuple(part.shape[:-1])
            blocks.append(part)
        filled = [b if b is not None else x.new_zeros(*lead, self.local_out[p])
                  for b, p in zip(blocks, self.fused.projections, strict=True)]
        # fused layout: per group, every projection's rows of that group ([q k v] per query group)
        return torch.cat([b.reshape(*lead, self.groups, -1) for b in filled], -1).reshape(*lead, -1)

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        """Adapter dropout. Where ``x`` is split over TP (row-parallel input columns, or tokens under
        sequence parallelism) each rank draws from megatron-core's model-parallel generator (one
        stream per TP rank: independent masks for the different slices); where ``x`` is the same on
        every rank, from the default generator (the same on every TP rank: the same mask)."""
        split = self.tp > 1 and (self.sequence_parallel or not self.fused.column)
        if not self.training or isinstance(self.dropout, nn.Identity) or not split:
            return self.dropout(x)
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        with get_cuda_rng_tracker().fork():
            return self.dropout(x)

    def hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if not self.adapter_enabled:
            return output
        out, bias = output
        return out + self.update(args[0]).to(out.dtype), bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, self.split_dims(), sharded_offsets)


def attach(chunks: list[Any], config: Any, spec: LoRASpec, seed: int) -> list[LinearAdapters]:
    """Add adapters for ``spec.target_modules`` to every dense decoder layer of ``chunks``; freeze
    everything else. Raises ``ValueError`` naming targets no linear of the model holds."""
    known = {p for fused in FUSED_LINEARS for p in fused.projections}
    unknown = [t for t in spec.target_modules if t not in known]
    if unknown:
        raise ValueError(f"train.lora.target_modules: {unknown} are not LoRA targets of the megatron backend, which "
                         f"targets {sorted(known)} (MoE experts are not targeted); use train.backend: fsdp for others")
    heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
    head_dim = config.kv_channels
    tp = config.tensor_model_parallel_size
    out_sizes = {"q_proj": heads * head_dim, "k_proj": groups * head_dim, "v_proj": groups * head_dim,
                 "o_proj": config.hidden_size, "gate_proj": config.ffn_hidden_size, "up_proj": config.ffn_hidden_size,
                 "down_proj": config.hidden_size}
    in_sizes = {"self_attention.linear_qkv": config.hidden_size, "self_attention.linear_proj": heads * head_dim,
                "mlp.linear_fc1": config.hidden_size, "mlp.linear_fc2": config.ffn_hidden_size}
    made: list[LinearAdapters] = []
    for chunk in chunks:
        chunk.requires_grad_(False)
        for layer in chunk.decoder.layers:
            for fused in FUSED_LINEARS:
                targets = [p for p in fused.projections if p in spec.target_modules]
                parent_path, _, leaf = fused.path.rpartition(".")
                parent = layer.get_submodule(parent_path)
                linear = getattr(parent, leaf, None)
                if not targets or linear is None:  # an MoE layer's mlp has experts, no linear_fc1
                    continue
                adapters = LinearAdapters(
                    fused, targets, layer_prefix=f"model.layers.{layer.layer_number - 1}", in_size=in_sizes[fused.path],
                    out_sizes=out_sizes, groups=(groups // tp) if leaf == "linear_qkv" else 1, spec=spec, seed=seed,
                    sequence_parallel=bool(config.sequence_parallel), device=linear.weight.device)
                setattr(parent, ADAPTER_KEY + leaf.removeprefix("linear_"), adapters)
                linear.register_forward_hook(adapters.hook)
                made.append(adapters)
    return made


def check_targets_found(adapters: list[LinearAdapters], spec: LoRASpec) -> None:
    """Every target must have found a linear on some rank (collective)."""
    from miles.trainer.collectives import all_gather_json

    found = {p for a in adapters for p in a.targets}
    everywhere = set().union(*(set(f) for f in all_gather_json(sorted(found))))
    missing = [t for t in spec.target_modules if t not in everywhere]
    if missing:
        raise ValueError(f"train.lora.target_modules: {missing} match no linear layer of this model (an MoE model's "
                         f"experts are not targeted: its attention projections are)")


def adapter_shards(adapters: list[LinearAdapters]) -> list[Shard]:
    """The adapter parameters as :class:`~miles_megatron.weights.Shard` s named by their PEFT name
    without its prefix (``model.layers.0.self_attn.q_proj.lora_A.weight``), for a ``WeightGather``."""
    from megatron.core import parallel_state as ps

    from miles_megatron.weights import Shard

    representative = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    shards = []
    for module in adapters:
        for projection, hf in module.hf_names.items():
            for part in ("lora_A", "lora_B"):
                param = getattr(module, part)[projection]
                dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
                shards.append(Shard(param=param, name=f"{hf}.{part}.weight", dim=dim, tp_size=module.tp,
                                    tp_rank=module.tp_rank, glu=False, representative=representative))
    return shards


def adapter_order(shards: list[Shard]) -> list[str]:
    """Every rank's adapter names in one order, the same on every rank (collective): by layer,
    then as the model holds them."""
    from miles.trainer.collectives import all_gather_json

    names: dict[str, None] = {}
    for part in all_gather_json([s.name for s in shards]):
        names.update(dict.fromkeys(part))
    layer = re.compile(r"^model\.layers\.(\d+)\.")
    ordered = list(names)
    return sorted(ordered, key=lambda n: (int(m.group(1)) if (m := layer.match(n)) else -1, ordered.index(n)))


class NamesAsTheyAre:
    """The bridge a ``WeightGather`` of adapters converts with: the names are already PEFT's."""

    def to_hf(self, group: dict[str, torch.Tensor], hf_config: Any, partial: bool = True) -> dict[str, torch.Tensor]:
        return dict(group)


def merged(base: Iterator[tuple[str, torch.Tensor]], adapters: dict[str, torch.Tensor], spec: LoRASpec,
           dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF weights ``base`` yields (rank 0) with each adapter folded in, in fp32, written as ``dtype``."""
    for name, tensor in base:
        module = name.removesuffix(".weight")
        a = adapters.get(f"{module}.lora_A.weight")
        if a is not None:
            b = adapters[f"{module}.lora_B.weight"]
            tensor = tensor.float().cpu() + spec.scaling * (b.float() @ a.float())
        yield name, tensor.to(dtype).cpu()


def is_adapter_key(key: str) -> bool:
    return ADAPTER_KEY in key
