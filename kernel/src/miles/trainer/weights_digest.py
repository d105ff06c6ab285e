"""A short fingerprint of a model's weights, to tell whether two trainings ended on the same bits.

``run.weights_digest`` logs it after every step as ``train/weights_digest``; ``miles replay``
computes it again after replaying a step. The weights after an update are a function of the
weights before it, the optimiser state and the step's gradients, so equal digests after a replay
from equal starting state mean the gradients came out the same too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DIGEST_BITS = 48
"""Bits kept: below float64's 53-bit mantissa, so the digest is a metric like any other (a float in
metrics.jsonl) and still reads back exactly."""


def weights_digest(named_weights: Iterable[tuple[str, torch.Tensor]]) -> float:
    """Hash every tensor's name, dtype, shape and bytes, in the order given; the first
    :data:`DIGEST_BITS` bits of the hash as an (exactly representable) float."""
    import torch

    h = hashlib.blake2b(digest_size=DIGEST_BITS // 8)
    for name, tensor in named_weights:
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}|{flat.dtype}|{tuple(tensor.shape)}|".encode())
        h.update(flat.view(torch.uint8).numpy().tobytes())  # bytes of any dtype (numpy has no bfloat16)
    return float(int.from_bytes(h.digest(), "big"))
