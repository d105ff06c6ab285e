"""Batch-invariant mixture-of-experts ops (true on-policy for MoE models), beside :mod:`miles_engine.invariant`.

transformers 5 runs an MoE layer as a router module (``Qwen3MoeTopKRouter``: ``F.linear`` gate,
fp32 softmax, top-k, optional renormalisation) and an experts module whose weights are 3-D
parameters (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) multiplied over however many
tokens each expert received; neither is an ``nn.Linear``, so :func:`~miles_engine.invariant.install_linears`
alone does not reach them. This module makes both invariant by construction:

* **Router** (:func:`router_forward`, a per-instance forward of each supported router): the gate
  logits come from :func:`miles_engine.invariant.linear` (one ``[1, H] @ [H, E]`` call per
  token); softmax, top-k and the renormalising sum then work on that token's own ``E`` (or
  ``top_k``) values along the last dimension, which PyTorch's CPU kernels compute row by row. So the
  engine and the trainer see identical logits, pick identical experts in identical order and get
  identical weights for every token.
* **Experts** (:func:`experts_forward`, registered with transformers' ``ExpertsInterface`` as
  :data:`~miles_engine.invariant.NAME`): every (token, expert) pair runs the expert's two
  projections through :func:`~miles_engine.invariant.linear` (one kernel call per row, whatever
  else the expert received), the gate activation and the routing weight element-wise, and a
  token's ``top_k`` outputs are summed **in rank order**: the order the router's ``torch.topk``
  returned them (descending routing weight), ``((o_0 + o_1) + o_2) + ...``, each ``+`` a correctly
  rounded element-wise add. The order is the token's own (its router's output), never the order
  of expert ids that happen to be hit in the batch.

Supported: the Qwen3-MoE layout (router class in :data:`ROUTERS`; experts with concatenated
``[gate; up]`` weights, not transposed, no bias, no post-expert norm). Anything else is refused by
:func:`install` with the class it cannot route. fp32 on the CPU; on CUDA the same code runs
bf16 or fp32, its linears on the Triton matmul of :mod:`miles_engine.invariant_triton` (checked on
the H200: ``test_invariant_moe.py``'s ``gpu`` test and the MoE ``miles train`` test on CUDA).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from miles_engine import invariant

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedModel

ROUTERS = frozenset({"Qwen3MoeTopKRouter"})
"""Router classes whose forward :func:`router_forward` reproduces (linear gate, fp32 softmax over
all experts, ``torch.topk``, renormalised when the config's ``norm_topk_prob`` says so)."""


def router_forward(router: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits [N, E], weights [N, k], experts [N, k])`` as ``Qwen3MoeTopKRouter.forward``
    computes them, with the gate through :func:`miles_engine.invariant.linear`."""
    weight = router.weight
    assert isinstance(weight, torch.Tensor)  # nn.Module types attributes as Tensor | Module
    hidden = hidden_states.reshape(-1, weight.shape[1])
    logits = invariant.linear(hidden, weight)  # [N, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_weights, top_experts = torch.topk(probs, int(router.top_k), dim=-1)  # type: ignore[arg-type]
    if router.norm_topk_prob:
        top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
    return logits, top_weights.to(logits.dtype), top_experts


def experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers experts interface: ``hidden_states [N, H]``, ``top_k_index`` /
    ``top_k_weights [N, k]`` (rank order) -> ``[N, H]``: per token, the routing-weighted outputs of
    its ``k`` experts summed in rank order; every projection one row at a time."""
    tokens, k = top_k_index.shape
    gate_up, down = experts.gate_up_proj, experts.down_proj
    assert isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
    if not tokens:
        return hidden_states.new_zeros(hidden_states.shape)
    pair_expert = top_k_index.reshape(-1)  # pair p = token * k + rank
    pair_weight = top_k_weights.reshape(-1, 1)
    pieces, where = [], []
    for expert in pair_expert.unique().tolist():  # grouping only saves Python calls: each row is its own call
        pairs = (pair_expert == expert).nonzero()[:, 0]
        x = hidden_states.index_select(0, pairs // k)
        h = experts._apply_gate(invariant.linear(x, gate_up[expert]))  # type: ignore[operator]
        y = invariant.linear(h, down[expert]) * pair_weight.index_select(0, pairs)
        pieces.append(y)
        where.append(pairs)
    per_pair = hidden_states.new_zeros(tokens * k, hidden_states.shape[1]).index_copy(
        0, torch.cat(where), torch.cat(pieces).to(hidden_states.dtype)).view(tokens, k, -1)
    out = per_pair[:, 0]
    for rank in range(1, k):  # the fixed order: rank 0 (highest routing weight) first
        out = out + per_pair[:, rank]
    return out


def _experts_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "_apply_gate")]


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that look like MoE routers (a class name ending in ``Router``)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Router")]


def install(model: PreTrainedModel, experts: int) -> int:
    """Make ``model``'s MoE layers invariant: each supported router gets :func:`router_forward` as
    its per-instance forward and the model's experts implementation becomes
    :data:`~miles_engine.invariant.NAME`. Returns how many MoE layers it covered; raises
    ``NotImplementedError`` naming what it cannot route (an unknown router class, an experts
    layout other than Qwen3-MoE's)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    routers = moe_routers(model)
    unknown = sorted({type(r).__name__ for r in routers} - ROUTERS)
    blocks = _experts_modules(model)
    layouts = sorted({type(m).__name__ for m in blocks
                      if getattr(m, "is_transposed", True) or not getattr(m, "is_concatenated", False)
                      or getattr(m, "has_bias", True) or not getattr(m, "has_gate", False)
                      or getattr(m, "has_post_expert_norm", True)})
    if unknown or layouts or not routers or len(routers) != len(blocks):
        what = (f"router classes {unknown}" if unknown else f"experts layouts {layouts}" if layouts
                else f"{len(routers)} routers for {len(blocks)} experts modules")
        raise NotImplementedError(
            f"rollout.true_on_policy supports MoE models with routers {sorted(ROUTERS)} and Qwen3-MoE's experts "
            f"layout (concatenated gate/up, not transposed, no bias); this one ({type(model).__name__}, {experts} "
            f"experts per MoE layer) has {what} (see docs/design/true-on-policy.md); turn true_on_policy off")
    ALL_EXPERTS_FUNCTIONS.register(invariant.NAME, experts_forward)
    model.set_experts_implementation(invariant.NAME)
    wrong = [type(m).__name__ for m in blocks if getattr(m.config, "_experts_implementation", None) != invariant.NAME]
    if wrong:
        raise NotImplementedError(f"transformers did not switch {wrong} to the invariant experts implementation")
    for router in routers:
        router.forward = _router_forward_of(router)  # per instance, on purpose
    return len(routers)


def _router_forward_of(router: nn.Module) -> Any:
    def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return router_forward(router, hidden_states)

    return forward
