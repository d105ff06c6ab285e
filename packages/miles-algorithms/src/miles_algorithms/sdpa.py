"""Which of PyTorch's scaled-dot-product attention kernels runs: shared by the train backends.

PyTorch picks a kernel by a priority order that is process-wide state, so it differs between
PyTorch versions and can be changed by any library imported beside it (with Transformer Engine
imported, the H200 ran flash-attention 2 where it had run cuDNN: 1.3x slower steps at 16K tokens,
docs/benchmarks/train.md). A backend that names its order gets the same kernel regardless.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from typing import Literal

SdpaBackend = Literal["cudnn", "flash", "efficient", "math"]
# every kernel, fastest first on Hopper (measured: docs/benchmarks/train.md); each one refuses
# what it cannot run (cuDNN: a lower-right causal mask, some head sizes) and the next one runs
ALL_FASTEST_FIRST: tuple[SdpaBackend, ...] = ("cudnn", "flash", "efficient", "math")

_TORCH_NAMES = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


def sdpa_preference(names: Sequence[SdpaBackend] | None, device_type: str) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of contexts in which ``scaled_dot_product_attention`` tries ``names`` in that order.
    ``None``: :data:`ALL_FASTEST_FIRST` on CUDA, PyTorch's own choice elsewhere (the CPU has one
    fused kernel and the math one).

    The same context must hold in backward: activation checkpointing recomputes the forward there,
    and a recompute that picked another kernel would save tensors of other shapes.
    """
    if names is None:
        names = ALL_FASTEST_FIRST if device_type == "cuda" else ()
    if not names:
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [getattr(SDPBackend, _TORCH_NAMES[name]) for name in names]
    if "set_priority" in inspect.signature(sdpa_kernel).parameters:
        return lambda: sdpa_kernel(backends, set_priority=True)
    return lambda: sdpa_kernel(backends)  # older torch: the set is restricted, the order is its own
