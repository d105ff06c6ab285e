"""Engine options: one dataclass shared by the Python API, ``miles serve engine`` and config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Device = Literal["auto", "cpu", "cuda"]
DType = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass(slots=True)
class EngineConfig:
    """How to run one embedded engine.

    :ivar model_path: a Hugging Face folder (config.json, safetensors, tokenizer).
    :ivar device: ``auto`` picks CUDA when present, else CPU.
    :ivar dtype: ``auto`` is bf16 on CUDA and fp32 on CPU (bf16 matmuls are ~20x slower on CPUs
        without native bf16).
    :ivar max_running_requests: most requests decoding together (the decode batch size).
    :ivar context_length: longest prompt + completion; default: the model's
        ``max_position_embeddings``.
    :ivar max_kv_tokens: KV-cache capacity in tokens (summed over running requests, counting each
        at its worst case ``prompt + max_new_tokens``); default from ``kv_cache_gb``.
    :ivar kv_cache_gb: memory for the KV cache when ``max_kv_tokens`` is not given; default 2 GiB
        on CPU, 40% of the free GPU memory after loading on CUDA.
    :ivar prefill_tokens_per_step: prompt tokens prefilled between two decode steps (at least one
        whole prompt), so arriving requests do not stall running ones for long.
    :ivar prefill_wait_ms: when the engine is idle and requests arrive, how long at most to keep
        gathering the rest of the burst before prefilling (0 = prefill at once). A rollout step sends
        hundreds of requests at once; they reach the engine over tens of ms, and each prefill forward
        costs ~35 ms of kernel launches on the H200 whatever its size, so prefilling them as they
        trickle in costs several forwards where one would do.
    :ivar prefill_gap_ms: the gathering ends earlier once no request arrived for this long (an
        isolated request waits only this long).
    :ivar plain_linear: keep transformers' own linear layers on CPU; by default fp32 CPU engines run
        them through oneDNN with pre-packed weights (~1.5x faster decode, a second copy of the
        linear weights in memory; see ``cpu_linear.py``).
    :ivar disable_cuda_graph: run decode steps eagerly on CUDA; by default each decode step is a
        replayed CUDA graph (see ``cuda_graphs.py``; not used for MoE models recording routes).
    :ivar seed: seeds the sampler of requests that carry no ``sampling_seed``.
    :ivar enable_deterministic_inference: batch-invariant numerics (SGLang's flag of the same
        name): a request's tokens and log-probs do not depend on which requests share its batch.
        With a ``sampling_seed`` per request, the same request then gives the same bits in any run.
        Only fp32 CPU engines with oneDNN can do it (every linear on the packed oneDNN path,
        decode attention row by row, new requests prefilled one at a time: slower); elsewhere the
        engine logs that only the seeds apply. See ``docs/design/reproducibility.md``.
    """

    model_path: str
    device: Device = "auto"
    dtype: DType = "auto"
    max_running_requests: int = 64
    context_length: int | None = None
    max_kv_tokens: int | None = None
    kv_cache_gb: float | None = None
    prefill_tokens_per_step: int = 2048
    prefill_wait_ms: float = 20.0
    prefill_gap_ms: float = 2.0
    plain_linear: bool = False
    disable_cuda_graph: bool = False
    seed: int = 0
    enable_deterministic_inference: bool = False
    tokenizer_path: str | None = None
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        errors = []
        if self.max_running_requests < 1:
            errors.append(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.context_length is not None and self.context_length < 2:
            errors.append(f"context_length must be >= 2, got {self.context_length}")
        if self.max_kv_tokens is not None and self.max_kv_tokens < 2:
            errors.append(f"max_kv_tokens must be >= 2, got {self.max_kv_tokens}")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            errors.append(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if self.prefill_tokens_per_step < 1:
            errors.append(f"prefill_tokens_per_step must be >= 1, got {self.prefill_tokens_per_step}")
        if self.prefill_wait_ms < 0:
            errors.append(f"prefill_wait_ms must be >= 0, got {self.prefill_wait_ms}")
        if self.prefill_gap_ms < 0:
            errors.append(f"prefill_gap_ms must be >= 0, got {self.prefill_gap_ms}")
        if errors:
            raise ValueError("invalid engine options: " + "; ".join(errors))
