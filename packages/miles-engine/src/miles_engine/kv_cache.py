"""The KV cache of the running batch: one dense slot per running request.

Layout: ``k`` and ``v`` are ``[layers, slots, kv_heads, length, head_dim]``. The request in row
``i`` of the decode batch lives in slot ``i``; when a request leaves, the last one moves into its
slot, so the batch is always slots ``0 .. B-1`` and a layer's keys for a decode step are the view
``k[layer, :B, :, :kv_len]``: no gather, no copy, no page table. Capacity grows (by reallocation)
in both slots and length as the batch needs it, and is released on :meth:`release`. With
``keep_allocation`` (CUDA graphs: a captured graph holds the cache's address) :meth:`release`
keeps the memory, so the weight sync's cache flush at every RL step does not force new graphs.

An instance is passed to the transformers model as its ``cache``: attention layers call
:meth:`update` with the new keys and values of the tokens being fed, and get back the keys and
values to attend to. Before each forward the scheduler says where those tokens go
(:meth:`plan_decode` / :meth:`plan_prefill`); the attention mask is built by the scheduler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_LENGTH_QUANTUM = 128


class SlotKVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, *, keep_allocation: bool = False) -> None:
        self.keep_allocation = keep_allocation
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.slots = 0  # capacity
        self.length = 0  # capacity
        self._plan: tuple[Any, ...] = ()

    @property
    def bytes_per_token(self) -> int:
        import torch

        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.slots * self.length * self.bytes_per_token

    def reserve(self, slots: int, length: int, *, max_slots: int, max_length: int) -> None:
        """Make room for ``slots`` requests of up to ``length`` tokens (contents are kept)."""
        if slots <= self.slots and length <= self.length:
            return
        import torch

        new_slots = min(max_slots, max(slots, self.slots * 2, 1)) if slots > self.slots else self.slots
        new_length = self.length
        if length > self.length:
            grown = max(length, self.length * 2)
            new_length = min(max_length, -(-grown // _LENGTH_QUANTUM) * _LENGTH_QUANTUM)
            new_length = max(new_length, length)
        shape = (self.num_layers, new_slots, self.num_kv_heads, new_length, self.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.k is not None and self.v is not None:  # both are set, or neither
            k[:, : self.slots, :, : self.length].copy_(self.k)
            v[:, : self.slots, :, : self.length].copy_(self.v)
        self.k, self.v, self.slots, self.length = k, v, new_slots, new_length

    def release(self) -> None:
        """Free the memory (kept with ``keep_allocation``: contents are dropped all the same, as
        every request in it is prefilled again before it decodes)."""
        if self.keep_allocation:
            return
        self.k = self.v = None
        self.slots = self.length = 0

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst`` (all layers)."""
        assert self.k is not None and self.v is not None  # the slots hold requests, so memory is reserved
        self.k[:, dst, :, :length].copy_(self.k[:, src, :, :length])
        self.v[:, dst, :, :length].copy_(self.v[:, src, :, :length])

    def plan_decode(self, batch: int, positions: torch.Tensor, kv_len: int) -> None:
        """Next forward: one token for each slot ``0 .. batch-1``, written at ``positions`` [B]
        (each row's current length); attention reads ``kv_len`` positions."""
        import torch

        # Row (b, h) of the new keys goes to flat row ((b * kv_heads + h) * length + positions[b])
        # of a layer viewed as [slots * kv_heads * length, head_dim]: one index_copy_ per layer.
        heads = torch.arange(self.num_kv_heads, device=self.device)
        rows = torch.arange(batch, device=self.device)[:, None] * self.num_kv_heads + heads[None, :]
        flat = (rows * self.length + positions[:, None]).reshape(-1)  # [B * kv_heads]
        self._plan = ("decode", flat, batch, kv_len)

    def plan_prefill_batch(self, first_slot: int, lengths: list[int], width: int) -> None:
        """Next forward: ``len(lengths)`` new requests, left-padded to ``width`` tokens, into slots
        ``first_slot ..``; row ``b``'s real tokens are its last ``lengths[b]`` columns and go to
        positions ``0 .. lengths[b]-1``. Attention reads only the new keys (nothing is cached yet)."""
        import torch

        device = self.device
        lengths_t = torch.tensor(lengths, device=device)
        pad = width - lengths_t  # [b]
        cols = torch.arange(width, device=device)
        valid = cols[None, :] >= pad[:, None]  # [b, width]
        rows, t = valid.nonzero(as_tuple=True)  # row-major: (row, column) of every real token
        slot = (first_slot + rows)[:, None] * self.num_kv_heads + torch.arange(self.num_kv_heads, device=device)[None, :]
        flat = (slot * self.length + (t - pad[rows])[:, None]).reshape(-1)  # [N * kv_heads]
        self._plan = ("prefill_batch", flat, valid)

    def plan_prefill(self, slot: int, start: int, length: int) -> None:
        """Next forward: ``length`` tokens of one request, written to slot ``slot`` from
        position ``start`` on; attention reads positions ``0 .. start+length-1``."""
        self._plan = ("prefill", slot, start, length)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values ``[B, kv_heads, q, head_dim]``; return what to attend to,
        ``[B, kv_heads, kv_len, head_dim]`` (views into the cache)."""
        assert self.k is not None and self.v is not None  # reserved before every forward
        k, v = self.k[layer_idx], self.v[layer_idx]
        if self._plan[0] == "decode":
            _, flat, batch, kv_len = self._plan
            k.view(-1, self.head_dim).index_copy_(0, flat, key_states.reshape(-1, self.head_dim))
            v.view(-1, self.head_dim).index_copy_(0, flat, value_states.reshape(-1, self.head_dim))
            return k[:batch, :, :kv_len], v[:batch, :, :kv_len]
        if self._plan[0] == "prefill_batch":
            _, flat, valid = self._plan
            # [b, kv_heads, width, d] -> real tokens only, [N * kv_heads, d] in (token, head) order
            k.view(-1, self.head_dim).index_copy_(0, flat, key_states.transpose(1, 2)[valid].reshape(-1, self.head_dim))
            v.view(-1, self.head_dim).index_copy_(0, flat, value_states.transpose(1, 2)[valid].reshape(-1, self.head_dim))
            return key_states, value_states
        _, slot, start, length = self._plan
        end = start + length
        k[slot, :, start:end] = key_states[0]
        v[slot, :, start:end] = value_states[0]
        return k[slot : slot + 1, :, :end], v[slot : slot + 1, :, :end]

    # transformers asks a few questions of any cache object it is given.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def __len__(self) -> int:
        return self.num_layers
