"""The attention-kernel preference both train backends run their attention in."""

from __future__ import annotations

import contextlib

import torch
from miles_algorithms.sdpa import ALL_FASTEST_FIRST, sdpa_preference


def _enabled() -> dict[str, bool]:
    cuda = torch.backends.cuda
    return {"cudnn": cuda.cudnn_sdp_enabled(), "flash": cuda.flash_sdp_enabled(),
            "efficient": cuda.mem_efficient_sdp_enabled(), "math": cuda.math_sdp_enabled()}


def test_named_kernels_are_the_only_ones_inside_and_all_come_back_after() -> None:
    before = _enabled()
    with sdpa_preference(["math"], "cpu")():
        assert _enabled() == {"cudnn": False, "flash": False, "efficient": False, "math": True}
    assert _enabled() == before


def test_default_is_every_kernel_fastest_first_on_cuda_and_pytorch_s_own_elsewhere() -> None:
    assert sdpa_preference(None, "cpu") is contextlib.nullcontext
    assert sdpa_preference([], "cuda") is contextlib.nullcontext
    with sdpa_preference(None, "cuda")():
        assert all(_enabled().values())
        order = getattr(torch._C, "_get_sdp_priority_order", None)  # the priority itself, where torch exposes it
        if order is not None:
            names = {int(getattr(torch.nn.attention.SDPBackend, n)): n for n in
                     ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")}
            got = [names[int(b)] for b in order() if int(b) in names]
            assert got == ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
    assert ALL_FASTEST_FIRST[0] == "cudnn"
