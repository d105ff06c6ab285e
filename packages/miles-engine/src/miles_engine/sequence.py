"""One request inside the engine: its tokens so far, how it stops, and what it returns."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from miles_contracts.wire.engine import FinishReason, SamplingParams

from miles_engine.sampling import RowSampling

if TYPE_CHECKING:
    import torch


@dataclass(eq=False, slots=True)
class Sequence:
    """Mutable state of one generate request; owned by the scheduler thread once submitted.

    ``kv_len`` counts the tokens whose keys and values are in the cache; the next forward feeds
    ``all_ids[kv_len:]``. ``routed`` holds the experts chosen at each fed position
    (``[positions, moe_layers, topk]`` chunks) when the caller asked for them.
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    sampling: RowSampling
    max_new_tokens: int  # already clamped to the context length
    stop_ids: frozenset[int]  # stop tokens: EOS and stop_token_ids (none with ignore_eos)
    return_logprob: bool
    return_routed_experts: bool
    on_finish: Callable[[Sequence], None]
    routed_start: int = 0  # first position whose experts the answer reports (routed_experts_start_len)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routed: list[torch.Tensor] = field(default_factory=list)
    routed_rows: int = 0
    kv_len: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (meta_info.cached_tokens)
    finish: FinishReason | None = None
    weight_version: str | None = None
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish is not None

    def append(self, token: int, logprob: float, stop_check: Callable[[Sequence], FinishReason | None]) -> None:
        """Record a sampled token and decide whether the request is done."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        self.finish = stop_check(self)

    def abort(self, message: str) -> None:
        if self.finish is None:
            self.finish = FinishReason(type="abort", message=message)

    def add_routing(self, rows: torch.Tensor) -> None:
        """Experts of newly fed positions, ``[n, moe_layers, topk]``; positions already recorded
        (a request re-prefilled after a retract) keep their first record."""
        end = self.kv_len
        start = end - rows.shape[0]
        if end <= self.routed_rows:
            return
        if start < self.routed_rows:
            rows = rows[self.routed_rows - start :]
        self.routed.append(rows)
        self.routed_rows = end
