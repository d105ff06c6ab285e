"""Bit-exact comparison of trainer and engine weights (check mode).

A tensor's checksum is the SHA-256 of its raw bytes: contiguous, row-major, in its own dtype, no
header. Engines answer ``GET /weights_checksum`` with the same definition, so equal checksums mean
equal bits. A trainer that pushes fp32 into a bf16 engine cannot match (the engine rounds on load):
check mode needs the trainer to send tensors in the engine's dtype, which real syncs do anyway.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def tensor_checksum(tensor: torch.Tensor) -> str:
    """SHA-256 hex digest of ``tensor``'s raw bytes (any dtype, device or layout)."""
    import torch

    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.sha256(raw.numpy()).hexdigest()


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class TensorTally:
    """Passes ``(name, tensor)`` pairs through unchanged, counting them and, when asked, hashing
    them, so a transport measures and checks a sync without a second pass over the weights."""

    def __init__(self, tensors: Iterable[tuple[str, torch.Tensor]], *, checksums: bool) -> None:
        self._tensors = tensors
        self._hash = checksums
        self._seen: set[str] = set()
        self.count = 0
        self.nbytes = 0
        self.checksums: dict[str, str] = {}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._tensors:
            if name in self._seen:
                raise ValueError(f"tensor {name!r} is pushed twice in one sync; every HF name must appear once")
            self._seen.add(name)
            self.count += 1
            self.nbytes += tensor_nbytes(tensor)
            if self._hash:
                self.checksums[name] = tensor_checksum(tensor)
            yield name, tensor


@dataclass(slots=True)
class ChecksumDiff:
    """How one engine's weights differ from what the trainer sent.

    :ivar differ: sent, but the engine holds other bytes.
    :ivar missing: sent, but the engine has no tensor of that name.
    :ivar still_noise: never sent, and unchanged since the engine filled its weights with noise.
    """

    differ: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    still_noise: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.differ or self.missing or self.still_noise)

    @property
    def names(self) -> list[str]:
        return self.differ + self.missing + self.still_noise

    def describe(self, limit: int = 8) -> str:
        parts = []
        for label, names in (("differ from the trainer's", self.differ),
                             ("were sent but the engine has no such tensor", self.missing),
                             ("were never sent and still hold noise", self.still_noise)):
            if names:
                shown = ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
                parts.append(f"{len(names)} tensor(s) {label}: {shown}")
        return "; ".join(parts)


def compare_checksums(sent: Mapping[str, str], engine: Mapping[str, str],
                      noise: Mapping[str, str] | None = None) -> ChecksumDiff:
    """Compare the checksums of what was ``sent`` with what the ``engine`` holds.

    ``noise`` (the engine's checksums right after its noise fill) lets tensors the trainer never
    sent be judged too: one still equal to its noise was missed by the sync. Tied weights (an
    ``lm_head`` sharing the embedding) are restored through their partner and so pass.
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
    return diff
