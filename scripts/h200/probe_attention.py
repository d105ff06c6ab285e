"""Which attention kernels this GPU + torch offer (device probe for docs/benchmarks/train.md).

    python scripts/h200/probe_attention.py

Prints JSON: the varlen API's signature, and for each SDPA backend alone whether a bf16 causal
GQA call (enable_gqa and repeated KV heads) runs, forward + backward, and its forward+backward time.
"""

from __future__ import annotations

import inspect
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    report: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    try:
        from torch.nn.attention import varlen

        report["varlen_attn"] = str(inspect.signature(varlen.varlen_attn))
    except Exception as exc:  # noqa: BLE001 - a probe reports whatever happens
        report["varlen_attn"] = f"unavailable: {exc!r}"
    b, hq, hkv, t, d = 1, 16, 8, 16384, 128
    q = torch.randn(b, hq, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, hkv, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flops = 3 * 2 * 2 * b * hq * t * t * d / 2  # fwd + bwd, causal half
    for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        for mode in ("enable_gqa", "repeat_kv"):
            def step(name: str = name, mode: str = mode) -> None:
                with sdpa_kernel([getattr(SDPBackend, name)]):
                    if mode == "enable_gqa":
                        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    else:
                        kk, vv = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
                        out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
                out.sum().backward()
            try:
                seconds = timed(step)
                report[f"{name}/{mode}"] = {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12}
            except Exception as exc:  # noqa: BLE001
                report[f"{name}/{mode}"] = f"error: {str(exc).splitlines()[0][:200]}"
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
