"""HF <-> megatron-core weight mapping, written as data.

A bridge is a list of :class:`Rule` rows: one megatron-core tensor, the HF tensors it is made of,
and the :class:`Transform` that joins them (HF -> megatron) and splits them back (megatron -> HF).
:class:`WeightMap` applies the rows and refuses to lose or invent a tensor: an HF tensor no row
reads, or a row whose inputs are missing, is an error listing every such name at once.

Reuse it for any transformer family (``miles-model-qwen3`` does); only the rows change. Torch is
imported by the transforms when they run, so importing this module stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


class BridgeError(ValueError):
    """A state dict does not fit the bridge's mapping (names missing, unexpected or mis-shaped)."""


@dataclass(frozen=True, slots=True)
class AttentionDims:
    """Head counts the fused QKV layout depends on.

    :ivar num_heads: query heads.
    :ivar num_groups: key/value heads (megatron's ``num_query_groups``).
    :ivar head_dim: channels per head (megatron's ``kv_channels``).
    """

    num_heads: int
    num_groups: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.num_heads % self.num_groups:
            raise BridgeError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_groups}) for megatron-core's grouped-query attention"
            )


class Transform(Protocol):
    """Turns the HF tensors of one row into the megatron tensor and back, bit-exactly."""

    def join(self, parts: Sequence[torch.Tensor]) -> torch.Tensor: ...

    def split(self, tensor: torch.Tensor, count: int) -> list[torch.Tensor]: ...


@dataclass(frozen=True, slots=True)
class Same:
    """One HF tensor is the megatron tensor (a rename)."""

    def join(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return parts[0]

    def split(self, tensor: torch.Tensor, count: int) -> list[torch.Tensor]:
        return [tensor]


@dataclass(frozen=True, slots=True)
class Concat:
    """Equal-sized HF tensors stacked along ``dim``: gate and up into ``linear_fc1`` (gate first,
    as megatron's gated-linear-unit chunks ``[gate; up]`` on the output dimension)."""

    dim: int = 0

    def join(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        import torch

        return torch.cat(list(parts), dim=self.dim)

    def split(self, tensor: torch.Tensor, count: int) -> list[torch.Tensor]:
        return [p.contiguous() for p in tensor.chunk(count, dim=self.dim)]


@dataclass(frozen=True, slots=True)
class InterleaveQKV:
    """Q, K and V projections fused into megatron's ``linear_qkv``.

    megatron-core groups the output rows per key/value group: for each of the ``G`` groups, its
    ``H/G`` query heads, then its key head, then its value head (``SelfAttention.
    get_query_key_value_tensors`` views the output as ``[G, (H/G + 2) * D]``). Works for weights
    (``q: [H*D, hidden]``, ``k, v: [G*D, hidden]`` -> ``[(H + 2G) * D, hidden]``) and biases
    (the same without the trailing ``hidden``).
    """

    dims: AttentionDims

    def join(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        import torch

        q, k, v = parts
        g, d = self.dims.num_groups, self.dims.head_dim
        rest = q.shape[1:]
        grouped = [q.reshape(g, -1, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)]
        return torch.cat(grouped, dim=1).reshape(-1, *rest)

    def split(self, tensor: torch.Tensor, count: int) -> list[torch.Tensor]:
        g, d = self.dims.num_groups, self.dims.head_dim
        per_group_q = self.dims.num_heads // g * d
        rest = tensor.shape[1:]
        q, k, v = tensor.reshape(g, per_group_q + 2 * d, *rest).split([per_group_q, d, d], dim=1)
        return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


SAME = Same()
GATE_UP = Concat(dim=0)


@dataclass(frozen=True, slots=True)
class Rule:
    """One megatron tensor and the HF tensors it is made of. Names may hold ``{layer}`` and
    ``{expert}``; :meth:`at` fills them in."""

    megatron: str
    hf: tuple[str, ...]
    transform: Transform = SAME

    def at(self, **index: int) -> Rule:
        return Rule(self.megatron.format(**index), tuple(h.format(**index) for h in self.hf), self.transform)


@dataclass(frozen=True, slots=True)
class Packed:
    """An HF tensor holding several rows' inputs stacked on dim 0, e.g. transformers' in-memory
    MoE experts ``gate_up_proj: [E, 2I, hidden]``. Unpacked before the rows run: slice ``e`` is
    split by ``transform`` into the ``per_slice`` names with ``{expert}`` = e.

    Checkpoints on disk store these per expert; only a live ``model.state_dict()`` packs them, so
    :meth:`WeightMap.to_hf` always writes the per-expert (checkpoint) form.
    """

    hf: str
    per_slice: tuple[str, ...]
    transform: Transform = SAME

    def at(self, **index: int) -> Packed:
        """Fill ``{layer}`` (etc.) and keep ``{expert}`` for :meth:`unpack`."""
        keep = {"expert": "{expert}", **index}
        return Packed(self.hf.format(**keep), tuple(n.format(**keep) for n in self.per_slice), self.transform)

    def unpack(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for e, piece in enumerate(tensor.unbind(0)):
            names = [n.format(expert=e) for n in self.per_slice]
            out.update(zip(names, self.transform.split(piece, len(names)), strict=True))
        return out


@dataclass(slots=True)
class WeightMap:
    """Concrete rows for one model (every layer and expert expanded).

    :ivar rules: one row per megatron tensor.
    :ivar aliases: HF names that may appear as a second name of another HF tensor (a tied
        ``lm_head.weight`` equal to the embedding); accepted only when bit-equal, then dropped.
    :ivar packed: HF tensors to unpack before the rows run (see :class:`Packed`).
    """

    rules: list[Rule]
    aliases: dict[str, str] = field(default_factory=dict)
    packed: list[Packed] = field(default_factory=list)

    def megatron_names(self) -> list[str]:
        return [r.megatron for r in self.rules]

    def hf_names(self) -> list[str]:
        return [h for r in self.rules for h in r.hf]

    def to_megatron(self, hf_state: Mapping[str, torch.Tensor], *, partial: bool = False) -> dict[str, torch.Tensor]:
        """HF tensors -> megatron-core tensors. Raises :class:`BridgeError` listing every missing
        or unexpected name. With ``partial``, ``hf_state`` may hold any subset (a train backend
        streams the checkpoint one decoder layer at a time) and exactly the megatron tensors whose
        HF inputs are all there come back; unknown names are still an error. Meta tensors convert
        to meta tensors (the names and shapes, without reading a weight)."""
        state = self._unpack(hf_state)
        wanted = set(self.hf_names())
        missing = [] if partial else sorted(wanted - state.keys())
        unexpected = sorted(state.keys() - wanted - self.aliases.keys())
        errors = self._alias_errors(state)
        if missing or unexpected or errors:
            raise BridgeError(_describe("HF", missing, unexpected, errors))
        out = {}
        for rule in self.rules:
            if partial and not all(h in state for h in rule.hf):
                continue
            out[rule.megatron] = _apply(rule, lambda r: r.transform.join([state[h] for h in r.hf]))
        return out

    def to_hf(self, mcore_state: Mapping[str, torch.Tensor], *, partial: bool = False) -> dict[str, torch.Tensor]:
        """megatron-core tensors -> HF tensors (checkpoint names). ``_extra_state`` entries
        (Transformer Engine's fp8 metadata) carry no weights and are ignored. With ``partial``,
        ``mcore_state`` may hold any subset (a train backend streams one layer at a time) and only
        the HF tensors made from it come back; unknown names are still an error."""
        names = {n for n in mcore_state if not n.endswith("_extra_state")}
        wanted = set(self.megatron_names())
        missing, unexpected = sorted(wanted - names), sorted(names - wanted)
        if partial:
            missing = []
        if missing or unexpected:
            raise BridgeError(_describe("megatron", missing, unexpected, []))
        out: dict[str, torch.Tensor] = {}
        for rule in self.rules:
            if partial and rule.megatron not in names:
                continue
            parts = _apply(rule, lambda r: r.transform.split(mcore_state[r.megatron], len(r.hf)))
            out.update(zip(rule.hf, parts, strict=True))
        return out

    def _unpack(self, hf_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state = dict(hf_state)
        for packed in self.packed:
            tensor = state.pop(packed.hf, None)
            if tensor is not None:
                state.update(packed.unpack(tensor))
        return state

    def _alias_errors(self, state: Mapping[str, torch.Tensor]) -> list[str]:
        import torch

        errors = []
        for alias, target in self.aliases.items():
            if alias not in state or target not in state or state[alias].is_meta or state[target].is_meta:
                continue  # a meta tensor (names and shapes only) has no values to compare
            if not torch.equal(state[alias], state[target]):
                errors.append(
                    f"{alias} differs from {target}, but the config ties them (tie_word_embeddings: true); "
                    f"fix the config or the checkpoint"
                )
        return errors


def _apply(rule: Rule, fn: Callable[[Rule], T]) -> T:
    try:
        return fn(rule)
    except (RuntimeError, ValueError) as exc:
        raise BridgeError(
            f"cannot map {', '.join(rule.hf)} <-> {rule.megatron} with {type(rule.transform).__name__}: {exc}"
        ) from exc


def _describe(side: str, missing: Iterable[str], unexpected: Iterable[str], errors: list[str]) -> str:
    lines = [f"the {side} state dict does not match the bridge's mapping:"]
    for title, names in (("missing", list(missing)), ("unexpected (no rule reads them)", list(unexpected))):
        if names:
            shown = ", ".join(names[:8]) + (f", ... ({len(names) - 8} more)" if len(names) > 8 else "")
            lines.append(f"  {title}: {shown}")
    lines += [f"  {e}" for e in errors]
    lines.append("  check that the checkpoint and config.json belong together and that the bridge's layout "
                 "matches the megatron layer spec")
    return "\n".join(lines)
