"""Weights in flight: HF-named tensors grouped into buckets for a weight transport."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class WeightBucket:
    """Tensors sent together (one flush of a transport).

    :ivar tensors: ``(hf_name, tensor)`` pairs, HF parameter names as the engine loads them.
    """

    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.tensors]


def bucketize(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[WeightBucket]:
    """Group tensors into buckets of at most ``bucket_bytes`` (a larger tensor gets its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket = WeightBucket()
    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if bucket.tensors and bucket.nbytes + size > bucket_bytes:
            yield bucket
            bucket = WeightBucket()
        bucket.tensors.append((name, tensor))
    if bucket.tensors:
        yield bucket


@dataclass(slots=True)
class TransferReport:
    """What a transport did in one sync.

    :ivar seconds: wall time of the whole sync.
    :ivar paused_seconds: the part of it during which engines did not generate.
    :ivar checked_engines: the engines whose copy of this sync check mode compared and found
        bit-exact (``weights.check``; a mismatch raises instead); empty when nothing was compared.
    """

    version: int
    num_tensors: int
    num_bytes: int
    seconds: float
    num_buckets: int = 1
    paused_seconds: float = 0.0
    checked_engines: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # JSON (the trainer wire, a report file) carries a tuple back as a list
        self.checked_engines = tuple(self.checked_engines)

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")
