"""The embedded engine's options: one table, :class:`EngineSection`.

It is the ``engine`` config section (``rollout.engine: embedded``), the ``miles serve engine`` /
``python -m miles_engine`` flags (derived from its fields by :mod:`miles.cli.section_args`), and,
with the model folder, device, dtype and deterministic mode added, the engine's own settings
(:class:`miles_engine.config.EngineConfig`, what ``Engine(path, **options)`` validates its keyword
arguments with). An option is added here once and appears in all three.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class EngineSection(BaseModel):
    """Config section ``engine``: options of the embedded engine. The model, device and dtype come
    from the ``model`` section, the deterministic mode from ``run.deterministic``.

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
    :ivar disable_radix_cache: ``false`` turns the prefix cache on: the KV of requests' token
        prefixes is kept and a request that starts with one prefills only the rest (see
        ``prefix_cache.py`` and ``docs/design/prefix-reuse.md``). Unset (the default) or ``true``:
        every request is prefilled in full. Off by default because a copied prefix's KV was computed
        by other forwards (decode steps) than a full prefill's and differs in the last bits (~1e-6 in
        fp32), so a request's log-probs would depend on what the engine ran before it, and on the
        H200 it saved prefill but not turn latency at 135M (docs/benchmarks/prefix-cache.md).
    :ivar radix_cache_tokens: most tokens the prefix cache keeps (least recently used prefixes are
        evicted beyond it); default: half of ``max_kv_tokens``. Its memory grows with use.
    :ivar seed: seeds the sampler of requests that carry no ``sampling_seed``.
    :ivar tokenizer_path: tokenizer folder, if not the model's.
    :ivar served_model_name: the name ``/get_model_info`` reports (default: the model folder's name).
    :ivar weight_dir: folders ``/update_weights_from_disk`` may read, besides the folder the model
        was loaded from (and, in a run, the run's folder); any other path (and any shard an index
        names outside its folder) is refused.
    :ivar weight_group_timeout: seconds to join a weight broadcast group (and for each collective
        in it): a trainer that never shows up costs a clear error, not a hang.
    :ivar paused_request_timeout: a request that has waited this long on a paused engine is
        aborted with a message saying so (a pause that is never continued must not hold callers forever).
    """

    model_config = ConfigDict(extra="forbid")

    max_running_requests: int = Field(default=64, ge=1, description="most requests decoding together")
    context_length: int | None = Field(
        default=None, ge=2, description="longest prompt + completion; default: the model's max_position_embeddings",
    )
    max_kv_tokens: int | None = Field(
        default=None, ge=2, description="KV-cache capacity in tokens; default: from kv_cache_gb",
    )
    kv_cache_gb: float | None = Field(
        default=None, gt=0, description="KV-cache memory if max_kv_tokens is unset; default 2 on CPU, 40% of the "
        "free GPU memory on CUDA",
    )
    prefill_tokens_per_step: int = Field(
        default=2048, ge=1, description="prompt tokens prefilled between two decode steps",
    )
    prefill_wait_ms: float = Field(
        default=20.0, ge=0, description="idle engine: gather a burst of arriving requests this long at most before "
        "prefilling (0: off)",
    )
    prefill_gap_ms: float = Field(default=2.0, ge=0, description="the gathering ends once no request arrived for this long")
    plain_linear: bool = Field(
        default=False, description="CPU: keep transformers' linear layers (no oneDNN weight packing; less memory, slower)",
    )
    disable_cuda_graph: bool = Field(
        default=False, description="CUDA: run decode steps eagerly instead of as replayed CUDA graphs",
    )
    disable_radix_cache: bool | None = Field(
        default=None, description="false: keep token prefixes' KV and prefill only the rest (the radix "
        "prefix cache); unset or true: prefill every request in full",
    )
    radix_cache_tokens: int | None = Field(
        default=None, ge=1, description="most tokens the prefix cache keeps; default: half of max_kv_tokens",
    )
    seed: int = Field(default=0, description="seed of requests without a sampling_seed")
    tokenizer_path: str | None = Field(default=None, description="tokenizer folder, if not the model's")
    served_model_name: str | None = Field(
        default=None, description="name reported by /get_model_info; default: the model folder's name",
    )
    weight_dir: list[str] = Field(
        default_factory=list, description="folders /update_weights_from_disk may read besides the model's own and "
        "the run's (add weight_transport.disk_dir here when you set it outside the run folder)",
    )
    weight_group_timeout: float = Field(
        default=300.0, gt=0, description="seconds to join a weight broadcast group, and for each of its collectives",
    )
    paused_request_timeout: float = Field(
        default=600.0, gt=0, description="a request waiting on a paused engine is aborted after this many seconds",
    )
