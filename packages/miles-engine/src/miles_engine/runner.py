"""Forward passes over the slot KV cache: prefill one request, or decode the whole batch.

The transformers model runs unchanged; the engine gives it explicit ``position_ids``, a 4-D
boolean attention mask (transformers passes a prepared 4-D mask through as is) and a
:class:`~miles_engine.kv_cache.SlotKVCache` as its ``cache``.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from miles_engine import cpu_linear
from miles_engine.cuda_graphs import DecodeGraphs, GraphCaptureError, bucket_for
from miles_engine.kv_cache import SlotKVCache
from miles_engine.loading import LoadedModel
from miles_engine.prefix_cache import PrefixCache
from miles_engine.routing import RoutingCapture, find_routers

if TYPE_CHECKING:
    import torch

    from miles_engine.sequence import Sequence

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, max_slots: int, *, pack_linears: bool = True,
                 cuda_graphs: bool = True, batch_invariant: bool = False, prefix_cache_tokens: int = 0) -> None:
        import torch

        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.max_slots = max_slots
        self.routing = RoutingCapture(self.model) if find_routers(self.model) else None
        graphed = cuda_graphs and loaded.device.type == "cuda" and self.routing is None
        self.cache = SlotKVCache(loaded.num_layers, loaded.num_kv_heads, loaded.head_dim, loaded.dtype, loaded.device,
                                 keep_allocation=graphed)
        self.graphs = DecodeGraphs(self.model, self.cache, max_slots) if graphed else None
        # KV of earlier requests' prefixes, beside the slot cache (0 tokens: no prefix cache)
        self.prefix = PrefixCache(self.cache, prefix_cache_tokens) if prefix_cache_tokens else None
        self.packed = None
        if pack_linears and loaded.device.type == "cpu" and loaded.dtype == torch.float32 and cpu_linear.available():
            self.packed = cpu_linear.PackedLinears(self.model, batch_invariant=batch_invariant)
        if batch_invariant and self.packed is None:
            log.warning("deterministic inference: batch-invariant numerics need an fp32 CPU engine with oneDNN "
                        "linears (this one: %s, %s, packed linears %s); requests with a sampling_seed still sample "
                        "reproducibly, but log-probs (and rarely tokens) can change with the batch",
                        loaded.device.type, loaded.dtype, "off" if not pack_linears else "unavailable")

    def weights_changed(self, storages: Collection[int] | None = None) -> None:
        """Call after any in-place change of the model's weights (derived copies follow);
        ``storages``: the ``untyped_storage().data_ptr()`` of what changed (``None``: anything may have).
        Cached prefixes were computed with the old weights: they are all dropped."""
        if self.packed is not None:
            self.packed.repack(storages)
        if self.prefix is not None:
            self.prefix.invalidate()

    def reserve(self, slots: int, length: int) -> None:
        """Make the slot cache hold ``slots`` requests of ``length`` tokens (contents kept)."""
        self.cache.reserve(slots, length, max_slots=self.max_slots, max_length=self.loaded.context_length)

    def prefill(self, seq: Sequence, slot: int) -> torch.Tensor:
        """Feed ``seq.all_ids[seq.kv_len:]`` into ``slot``; returns the next-token logits ``[1, V]``
        and advances ``seq.kv_len``."""
        import torch

        ids = seq.all_ids[seq.kv_len :]
        start, length = seq.kv_len, len(ids)
        end = start + length
        self.reserve(slot + 1, end)
        self.cache.plan_prefill(slot, start, length)
        device = self.device
        positions = torch.arange(start, end, device=device)
        # [1, 1, T, end]: query i (at position start+i) sees keys 0 .. start+i
        mask = (torch.arange(end, device=device)[None, :] <= positions[:, None])[None, None]
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor([ids], device=device), position_ids=positions[None], attention_mask=mask,
                cache=self.cache, use_cache=True, logits_to_keep=1,
            )
        seq.kv_len = end
        if self.routing is not None:
            routes = self.routing.take()
            if seq.return_routed_experts:
                seq.add_routing(routes.cpu())
        return out.logits[:, -1]

    def prefill_batch(self, seqs: Seq[Sequence], first_slot: int) -> torch.Tensor:
        """Prefill several new requests (``kv_len == 0``) in one forward, into slots
        ``first_slot ..``; returns each one's next-token logits ``[b, V]``.

        Rows are left-padded so every last token sits in the last column (``logits_to_keep=1``);
        a pad query attends only to itself, so no row is fully masked.
        """
        import torch

        lengths = [len(s.prompt_ids) + len(s.output_ids) for s in seqs]
        width = max(lengths)
        self.reserve(first_slot + len(seqs), width)
        self.cache.plan_prefill_batch(first_slot, lengths, width)
        device = self.device
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
            ids[row, width - n :] = torch.tensor(seq.all_ids)
        pad = width - torch.tensor(lengths, device=device)  # [b]
        cols = torch.arange(width, device=device)
        positions = (cols[None, :] - pad[:, None]).clamp_(min=0)  # [b, width]
        real_key = cols[None, :] >= pad[:, None]  # [b, width]
        causal = cols[None, :] <= cols[:, None]  # [width(q), width(k)]
        mask = (causal[None] & real_key[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)[None]
        with torch.inference_mode():
            out = self.model(input_ids=ids.to(device), position_ids=positions, attention_mask=mask[:, None],
                             cache=self.cache, use_cache=True, logits_to_keep=1)
        for seq, n in zip(seqs, lengths, strict=True):
            seq.kv_len = n
        if self.routing is not None:
            routes = self.routing.take().reshape(len(seqs), width, self.routing.num_layers, -1)
            for row, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
                if seq.return_routed_experts:
                    seq.add_routing(routes[row, width - n :].cpu())
        return out.logits[:, -1]

    def decode(self, seqs: Seq[Sequence]) -> torch.Tensor:
        """Feed each request's last token (request ``i`` lives in slot ``i``); returns ``[B, V]``
        and advances every ``kv_len``."""
        import torch

        batch = len(seqs)
        positions_list = [s.kv_len for s in seqs]
        kv_len = max(positions_list) + 1
        # A graph's pad rows write into the slots after the batch: reserve the whole bucket.
        slots = batch if self.graphs is None else bucket_for(batch, self.graphs.buckets)
        self.reserve(slots, kv_len)
        if self.graphs is not None:
            try:
                logits = self.graphs.decode([s.output_ids[-1] for s in seqs], positions_list)
            except GraphCaptureError:
                # Serve on, eagerly: a model the graphs cannot capture must not take the engine down.
                log.exception("CUDA graphs are off for this engine from now on")
                self.graphs = None
                return self.decode(seqs)
            for s in seqs:
                s.kv_len += 1
            return logits
        device = self.device
        positions = torch.tensor(positions_list, device=device)
        self.cache.plan_decode(batch, positions, kv_len)
        # [B, 1, 1, kv_len]: row b sees its own positions 0 .. positions[b]
        mask = (torch.arange(kv_len, device=device)[None, :] <= positions[:, None])[:, None, None]
        tokens = torch.tensor([[s.output_ids[-1]] for s in seqs], device=device)
        with torch.inference_mode():
            out = self.model(input_ids=tokens, position_ids=positions[:, None], attention_mask=mask,
                               cache=self.cache, use_cache=True)
        for s in seqs:
            s.kv_len += 1
        if self.routing is not None:
            routes = self.routing.take()
            wanted = [i for i, s in enumerate(seqs) if s.return_routed_experts]
            if wanted:
                host = routes.cpu()
                for i in wanted:
                    seqs[i].add_routing(host[i : i + 1])
        return out.logits[:, -1]
