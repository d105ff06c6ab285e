"""Routing replay in a Hugging Face MoE model (the ``fsdp`` backend trains these).

transformers 5 gives each MoE layer a router module (Qwen3-MoE: ``Qwen3MoeTopKRouter`` at
``model.layers.{i}.mlp.gate``, a linear gate ``weight [E, hidden]``) whose forward returns a tuple
holding ``scores [N, k]`` and ``indices [N, k]``; the experts module then runs exactly ``indices``
weighted by ``scores``. The model bridge's :class:`~miles_contracts.MoeLayerMap` says where each
router is, so a forward hook on it, by path rather than by guessing from names, can replace
``indices`` with the recorded experts and ``scores`` with the gate weights the *current* logits
give those experts (softmax or sigmoid over all experts in float32, gathered, renormalised when the
map says so -- the router's own formula), so gradients still reach the router.

The logits are recomputed from the router's input and weight (one ``[N, hidden] x [hidden, E]``
product, small next to the experts) rather than read from its output: transformers 5.0 returns
the softmax probabilities where 5.17+ return the logits, in the same slot. A token whose recorded
experts are the router's own top-k, in the same order, keeps the router's own weights: they are
the same formula's values, and under ``rollout.true_on_policy`` (an invariant router) the very bits
the engine used, which a recomputation through a batched product would not be.

The hooks stay on the routers once installed and cost one attribute check per router call while no
table is armed. They are excluded from ``torch.compile`` tracing (a graph break at each router):
the recorded table changes every micro-batch and must not be baked into a graph.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from miles.errors import MilesError
from miles_contracts import MoeLayerMap

from miles_r3.replay import Replayer, RoutingStats


class HFRouterReplay(Replayer):
    """Forward hooks on the routers the map names, for one HF model."""

    def __init__(self, model: torch.nn.Module, layer_map: MoeLayerMap, stats: RoutingStats) -> None:
        super().__init__(stats)
        self.layer_map = layer_map
        self.num_experts, self.top_k, self.columns = layer_map.num_experts, layer_map.top_k, len(layer_map.moe_layers)
        self._handles = []
        for column, layer in enumerate(layer_map.moe_layers):
            path = layer_map.router_path(layer)
            try:
                router = model.get_submodule(path)
            except AttributeError:
                raise MilesError(f"the MoE layer map names router {path!r}, which {type(model).__name__} does not have; "
                                 f"the model bridge's moe_layers() does not fit this model") from None
            weight = getattr(router, "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != layer_map.num_experts:
                raise MilesError(f"router {path!r} ({type(router).__name__}) has no linear gate weight "
                                 f"[{layer_map.num_experts}, hidden]; routing replay recomputes gate logits from it")
            self._handles.append(router.register_forward_hook(self._hook(column, path), with_kwargs=True))

    def recomputes(self, model: torch.nn.Module) -> bool:
        if not (torch.is_grad_enabled() and model.training):
            return False
        # transformers 5.2x renamed the flag; older 5.x only has the first spelling
        flag = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else "is_gradient_checkpointing"
        return bool(getattr(model, flag, False))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, column: int, path: str) -> Any:
        @torch.compiler.disable
        def replay(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
            if self.table is None:
                return None
            slot_scores, slot_indices = _router_outputs(output, self.top_k, path)
            scores, own = output[slot_scores], output[slot_indices]
            chosen = self.choose(column, own, path)
            if chosen is None:
                return None
            experts, recorded = chosen
            hidden = args[0] if args else kwargs["hidden_states"]
            weight = cast(torch.Tensor, module.weight)  # a [E, hidden] tensor: checked when the hook was installed
            logits = F.linear(hidden.reshape(-1, weight.shape[1]), weight, getattr(module, "bias", None))
            # where the recorded experts are the router's own top-k in its own order, its own scores
            # are those gate weights already (and, under true on-policy, the engine's bits)
            recomputed = recorded & ~(experts == own.long()).all(dim=-1)
            weights = torch.where(recomputed[:, None], gate_weights(logits, experts, self.layer_map).to(scores.dtype),
                                  scores)
            replaced = list(output)
            replaced[slot_scores], replaced[slot_indices] = weights, experts.to(own.dtype)
            return type(output)(replaced)

        return replay


def gate_weights(logits: torch.Tensor, experts: torch.Tensor, layer_map: MoeLayerMap) -> torch.Tensor:
    """``[N, k]`` float32 weights of ``experts [N, k]`` from router ``logits [N, E]``, as the router
    computes them for its own top-k."""
    scores = torch.softmax(logits.float(), dim=-1) if layer_map.scoring == "softmax" else torch.sigmoid(logits.float())
    weights = scores.gather(1, experts)
    if layer_map.normalize_top_k:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights


def _router_outputs(output: Any, top_k: int, path: str) -> tuple[int, int]:
    """Positions of ``scores [N, k]`` (floating) and ``indices [N, k]`` (integer) in a router's output tuple."""
    items = list(enumerate(output)) if isinstance(output, tuple) else []
    tensors = [(i, t) for i, t in items if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[-1] == top_k]
    scores = next((i for i, t in reversed(tensors) if t.is_floating_point()), None)  # last: logits come first
    indices = next((i for i, t in tensors if not t.is_floating_point()), None)
    if scores is None or indices is None:
        got = [f"{type(t).__name__}{tuple(t.shape) if isinstance(t, torch.Tensor) else ''}"
               for t in (output if isinstance(output, tuple) else (output,))]
        raise MilesError(f"router {path!r} returned {got}; routing replay needs a router returning expert scores "
                         f"[tokens, {top_k}] and expert indices [tokens, {top_k}] (transformers 5 MoE routers)")
    return scores, indices
