"""Bit-exact comparison of trainer and engine weights (check mode).

A tensor's checksum is the SHA-256 of its raw bytes: contiguous, row-major, in its own dtype, no
header. Engines answer ``GET /weights_checksum`` with the same definition, so equal checksums mean
equal bits. A trainer that pushes fp32 into a bf16 engine cannot match (the engine rounds on load):
check mode needs the trainer to send tensors in the engine's dtype, which real syncs do anyway.

Names count once per stored tensor on both sides: the trainer skips a tensor that is the very same
bytes as one it already sent (a tied ``lm_head`` yielded beside the embedding it shares), and an
engine reports each stored tensor once, under its checkpoint name, never a tied alias.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def tensor_checksum(tensor: torch.Tensor) -> str:
    """SHA-256 hex digest of ``tensor``'s raw bytes (any dtype, device or layout)."""
    import torch

    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.sha256(raw.numpy().data).hexdigest()  # .data: the buffer, typed (no copy)


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class TensorTally:
    """Passes ``(name, tensor)`` pairs through, counting them and, when asked, hashing them, so a
    transport measures and checks a sync without a second pass over the weights.

    A tensor that is a view of exactly the bytes of one passed earlier and still alive (same
    storage, offset, shape, strides and dtype: a tied weight under its second name) is not passed
    on, but recorded in :attr:`aliases`: the engine loads it through its partner, and counting it
    would count its bytes twice. Only live tensors are compared, so a producer that frees a tensor
    and gets the same memory for the next one is never mistaken for an alias.
    """

    def __init__(self, tensors: Iterable[tuple[str, torch.Tensor]], *, checksums: bool) -> None:
        self._tensors = tensors
        self._hash = checksums
        self._seen: set[str] = set()
        self._live: dict[tuple, tuple[str, weakref.ref]] = {}
        self.count = 0
        self.nbytes = 0
        self.checksums: dict[str, str] = {}
        self.aliases: dict[str, str] = {}  # skipped name -> the name it shares its bytes with
        self.not_floating: set[str] = set()  # names the engines' noise fill leaves alone

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._tensors:
            if name in self._seen:
                raise ValueError(f"tensor {name!r} is pushed twice in one sync; every HF name must appear once")
            self._seen.add(name)
            partner = self._alias_of(name, tensor)
            if partner is not None:
                self.aliases[name] = partner
                continue
            self.count += 1
            self.nbytes += tensor_nbytes(tensor)
            if not tensor.is_floating_point():
                self.not_floating.add(name)
            if self._hash:
                self.checksums[name] = tensor_checksum(tensor)
            yield name, tensor

    def _alias_of(self, name: str, tensor: torch.Tensor) -> str | None:
        if tensor.numel() == 0:
            return None
        key = (tensor.device, tensor.dtype, tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
        earlier = self._live.get(key)
        if earlier is not None and earlier[1]() is not None:
            return earlier[0]
        self._live[key] = (name, weakref.ref(tensor))
        return None


@dataclass(slots=True)
class ChecksumDiff:
    """How one engine's weights differ from what the trainer sent.

    :ivar differ: sent, but the engine holds other bytes.
    :ivar missing: sent, but the engine reports no tensor of that name.
    :ivar still_noise: never sent, and unchanged since the engine filled its weights with noise.
    :ivar unproven: sent, but the engine's noise already had exactly these bytes, so the check
        cannot tell a sync from none (another ``check_seed`` gives other noise).
    """

    differ: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    still_noise: list[str] = field(default_factory=list)
    unproven: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.differ or self.missing or self.still_noise or self.unproven)

    @property
    def names(self) -> list[str]:
        return self.differ + self.missing + self.still_noise + self.unproven

    def describe(self, limit: int = 8) -> str:
        parts = []
        for label, names in (("differ from the trainer's", self.differ),
                             ("were sent but the engine has no such tensor (an engine reports a tied alias "
                              "under the name of the tensor it shares)", self.missing),
                             ("were never sent and still hold noise", self.still_noise),
                             ("equalled the trainer's already after the noise fill, so the check proves nothing "
                              "for them (set weight_transport.check_seed to another value)", self.unproven)):
            if names:
                shown = ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
                parts.append(f"{len(names)} tensor(s) {label}: {shown}")
        return "; ".join(parts)


def compare_checksums(sent: Mapping[str, str], engine: Mapping[str, str], noise: Mapping[str, str] | None = None,
                      *, not_floating: Collection[str] = ()) -> ChecksumDiff:
    """Compare the checksums of what was ``sent`` with what the ``engine`` holds.

    ``noise`` (the engine's checksums right after its noise fill) lets tensors the trainer never
    sent be judged too: one still equal to its noise was missed by the sync. It also shows a sent
    tensor whose noise happened to be its true bytes (``unproven``), except the ``not_floating``
    ones, which a noise fill leaves alone. Engines report each stored tensor once (a tied
    ``lm_head`` is restored through the embedding it shares and not reported on its own).
    """
    diff = ChecksumDiff()
    for name, digest in sent.items():
        held = engine.get(name)
        if held is None:
            diff.missing.append(name)
        elif held != digest:
            diff.differ.append(name)
    if noise:
        diff.still_noise = [n for n, d in engine.items() if n not in sent and noise.get(n) == d]
        diff.unproven = [n for n, d in sent.items()
                         if n not in not_floating and n not in diff.differ and noise.get(n) == d]
    return diff
