"""Batch-invariant forward ops shared by the embedded engine and the fsdp trainer (true on-policy).

With ``rollout.true_on_policy`` both sides run the unchanged transformers model with these ops in
place, so a token's log-prob is the same bits whether the engine computed it in a decode batch of
64, in a one-request prefill, or the trainer in a packed micro-batch. Each op is invariant *by
construction*: every output row is computed by a kernel call whose shapes, strides, alignment and
inputs are that row's own, so nothing about the rest of the batch can reach its reduction order.

* :func:`linear` multiplies one row at a time (``[1, K] @ [K, N]``, a fresh 64-byte-aligned copy
  of the row; MKL documents results that depend on alignment). Measured on this project's CPUs,
  neither MKL's sgemm (three paths: 1, 2-3, 4+ rows) nor oneDNN (a single row differed on K=1536)
  is invariant on its own; see docs/design/true-on-policy.md. The backward is the ordinary batched
  one: only forward values must agree.
* :func:`attention` (registered with transformers as :data:`NAME`) attends each query row over
  exactly its unmasked keys, gathered in position order into a contiguous ``[kv_heads, n, D]``
  block: prefill, decode and the trainer's packed or padded rows all make the same call for the
  same token.
* :func:`token_logprobs` is the fp32 log-softmax the sampler draws from (it calls this function),
  so the reported log-prob is the one the token was sampled with, and the trainer's equals it.

RMSNorm, rotary embedding, SiLU and residual adds stay transformers' own code, on both sides:
they are element-wise or reduce one row's last dimension serially (PyTorch reduces a contiguous
last dimension of fewer than 32768 elements in one thread, in a fixed vector order), which the
tests check with 1, 3 and 64 rows. On CUDA tensors every op here dispatches to the Triton kernels
of :mod:`miles_engine.invariant_triton` (fixed tiles, no split reductions; RMSNorm too, through
:func:`install_norms`), in bf16 or fp32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedModel

NAME = "miles_invariant"
_ALIGN = 64  # bytes; torch's CPU allocator aligns fresh tensors to 64


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous at a 64-byte-aligned address (a copy when it is not already)."""
    if t.is_contiguous() and t.data_ptr() % _ALIGN == 0:
        return t
    return t.contiguous().clone()


def _rows_forward(flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    import torch.nn.functional as F

    if flat.is_cuda:  # one fixed-tile Triton matmul (invariant_triton.py): no per-row loop needed
        from miles_engine import invariant_triton

        return invariant_triton.matmul(flat, weight, bias)
    weight = _aligned(weight)
    out = flat.new_empty(flat.shape[0], weight.shape[0])
    for i in range(flat.shape[0]):
        out[i] = F.linear(flat[i : i + 1].clone(), weight, bias)[0]
    return out


class _RowLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(flat, weight)
        ctx.has_bias = bias is not None
        return _rows_forward(flat, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        flat, weight = ctx.saved_tensors
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad.t() @ flat if ctx.needs_input_grad[1] else None
        grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with each row of ``x`` multiplied on its own (batch-invariant)."""
    flat = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        out = _RowLinear.apply(flat, weight, bias)
    else:
        out = _rows_forward(flat, weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def check_supported(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a device and dtype the invariant ops have no kernels for: fp32 on the CPU (PyTorch row
    loops), bf16 or fp32 on CUDA (the Triton kernels, which need ``triton`` importable)."""
    if device.type == "cpu" and dtype == torch.float32:
        return
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float32):
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            raise ValueError("true_on_policy on CUDA runs Triton kernels, and triton is not installed; "
                             "install the triton that matches torch")
        return
    raise ValueError(f"true_on_policy needs fp32 on the CPU or bf16/fp32 on CUDA, got {device.type} {dtype}; "
                     f"set model.dtype (and model.device) accordingly")


def install_linears(model: PreTrainedModel) -> int:
    """Route every ``nn.Linear`` of ``model`` through :func:`linear` (a per-instance forward: the
    module, its weight and its name stay as they are). Returns how many layers it covered.

    A mixture-of-experts model's routers and experts are no ``nn.Linear`` (3-D expert weights
    multiplied with ``F.linear`` on however many tokens each expert got; measured: the tiny
    Qwen3-MoE differed by 1.5e-7 between a row alone and padded with others), so
    :func:`miles_engine.invariant_moe.install` routes them too, and refuses the layouts it does not
    support."""
    from torch import nn

    text = model.config.get_text_config()
    experts = max(int(getattr(text, name, 0) or 0) for name in ("num_experts", "num_local_experts", "n_routed_experts"))
    if experts:
        from miles_engine import invariant_moe

        invariant_moe.install(model, experts)

    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for layer in layers:
        layer.forward = _linear_forward_of(layer)  # type: ignore[method-assign]  # per instance, on purpose
    install_norms(model)
    return len(layers)


def install_norms(model: nn.Module) -> int:
    """Give every RMSNorm of ``model`` (a module class named ``*RMSNorm`` with a ``weight`` and an
    epsilon) a forward that runs the Triton row kernel on CUDA tensors. On the CPU the module's own
    forward stays: PyTorch reduces a row's last dimension serially there (see the module docstring),
    while on the GPU its reduction kernel chooses how to split the work from the tensor's shape, so
    nothing promises that a row reduces the same way in every batch."""
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm") and _epsilon(m) is not None]
    for norm in norms:
        norm.forward = _norm_forward_of(norm, norm.forward)
    return len(norms)


def _epsilon(norm: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(norm, name, None)
        if isinstance(value, float):
            return value
    return None


def _norm_forward_of(norm: nn.Module, own: Any) -> Any:
    eps = _epsilon(norm)
    assert eps is not None

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not x.is_cuda:
            return own(x)
        from miles_engine import invariant_triton

        weight = norm.weight
        assert isinstance(weight, torch.Tensor)
        return invariant_triton.rms_norm_op(x, weight, eps)

    return forward


def _linear_forward_of(layer: nn.Linear) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return linear(x, layer.weight, layer.bias)

    return forward


def _attend_one(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token: ``query [kv_heads, group, D]`` over ``key``/``value`` ``[kv_heads, n, D]``."""
    scores = torch.matmul(query, key.transpose(1, 2)) * scale  # [kv_heads, group, n]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    return torch.matmul(probs, value)  # [kv_heads, group, D]


def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention interface: ``query [B, H, Q, D]``, ``key``/``value`` ``[B, KV, L, D]``,
    ``attention_mask`` boolean ``[B, 1, Q, L]`` (True = attend) or None (causal, queries are the
    last ``Q`` of the ``L`` positions). Returns ``[B, Q, H, D]``."""
    if dropout:
        raise ValueError("true on-policy attention runs without dropout (the model config sets attention_dropout)")
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        raise TypeError(f"true on-policy attention needs a boolean mask, got {attention_mask.dtype}")
    batch, heads, queries, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else dim**-0.5
    if query.is_cuda:  # a Triton kernel walking each query's own key range (invariant_triton.py)
        from miles_engine import invariant_triton

        return invariant_triton.attention_op(query, key, value, attention_mask, scale), None
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, queries, dim)
    positions = torch.arange(length, device=query.device)
    rows = []
    for b in range(batch):
        outs = []
        for i in range(queries):
            if attention_mask is None:
                keys = positions[: length - queries + i + 1]
            else:
                keys = attention_mask[b, 0, i].nonzero()[:, 0]  # ascending: position order
            q = grouped[b, :, :, i].contiguous()  # [kv_heads, group, D]
            k = key[b].index_select(1, keys)  # a fresh contiguous [kv_heads, n, D]
            v = value[b].index_select(1, keys)
            outs.append(_attend_one(q, k, v, scale).reshape(heads, dim))
        rows.append(torch.stack(outs))  # [Q, H, D]
    return torch.stack(rows), None


def register() -> str:
    """Register :func:`attention` (and a boolean 4-D mask for it) with transformers; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def token_logprobs(scaled_logits: torch.Tensor) -> torch.Tensor:
    """``[R, V]`` fp32 log-probs of logits already divided by the temperature: what the sampler
    draws from and reports, and what the trainer recomputes (one row at a time in the kernel)."""
    if scaled_logits.is_cuda:  # PyTorch's CUDA kernel is not promised to reduce a row the same way for any row count
        from miles_engine import invariant_triton

        return invariant_triton.log_softmax_op(scaled_logits)
    return torch.log_softmax(scaled_logits.float(), dim=-1)
