"""Routing replay in a megatron-core ``GPTModel`` (the ``megatron`` backend trains these).

megatron-core's ``TopKRouter.routing`` computes its top-k through
``topk_routing_with_score_function``, which asks the router's ``router_replay`` object (when one
is set) for ``(values, indices)`` via ``get_replay_topk(scores, topk, num_groups, group_topk,
default_compute_topk)``. megatron-core only sets that attribute when ``moe_enable_routing_replay``
is on, and then drives it through process-global state; here each router gets its own small object
instead, so replay needs no model-config flag and no global list: the object computes the
router's own top-k (for the agreement statistics) and returns the recorded experts with
``scores.gather`` over them. megatron-core then turns those scores into gate weights exactly as it
does for its own choice (softmax over the chosen logits, or the pre-softmax probabilities), so
gradients reach the router.

Layers are matched by ``router.layer_number`` (global, 1-based, pipeline stages included) against
the MoE layers of the model's ``moe_layer_freq``; the recorded experts' columns are the MoE layers
in that order (the model bridge's map, the same layers). The routers see ``[s, b]`` tokens
flattened sequence-major, a rank's shard under sequence or context parallelism: the backend says
which batch position each is in through ``ForwardContext.state["token_positions"]``.

Refused, with the reason: the fused router (``moe_router_fusion``, a Transformer Engine kernel that
never consults ``router_replay``) and sinkhorn routing.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from miles.errors import MilesError

from miles_r3.replay import Replayer, RoutingStats

if TYPE_CHECKING:
    from megatron.core.transformer.moe.router import TopKRouter

ROUTER_MODULE = "megatron.core.transformer.moe.router"


def megatron_routers(model: torch.nn.Module) -> list[TopKRouter]:
    """The model's megatron-core ``TopKRouter`` modules (none if megatron-core was never imported)."""
    module = sys.modules.get(ROUTER_MODULE)
    if module is None:
        return []
    return [m for m in model.modules() if isinstance(m, module.TopKRouter)]


def moe_layer_indices(config: Any) -> list[int]:
    """0-based global indices of the MoE layers ``config.moe_layer_freq`` describes."""
    freq, layers = config.moe_layer_freq, config.num_layers
    if isinstance(freq, int):
        return [i for i in range(layers) if i % freq == 0]
    return [i for i, flag in enumerate(freq) if flag]


class MegatronRouterReplay(Replayer):
    """Replay objects on every ``TopKRouter`` of one model."""

    def __init__(self, routers: list[TopKRouter], stats: RoutingStats) -> None:
        super().__init__(stats)
        config = routers[0].config
        if getattr(config, "moe_router_fusion", False):
            raise MilesError("routing replay needs megatron-core's unfused router: set moe_router_fusion=False "
                             "(the fused Transformer Engine kernel does not consult router_replay)")
        self.config = config
        moe_layers = moe_layer_indices(config)
        self.num_experts, self.top_k, self.columns = config.num_moe_experts, config.moe_router_topk, len(moe_layers)
        for router in routers:
            if getattr(router, "routing_type", "aux_loss") == "sinkhorn":
                raise MilesError("routing replay does not support sinkhorn routing (it never consults router_replay)")
            layer = router.layer_number - 1
            if layer not in moe_layers:
                raise MilesError(f"router of layer {router.layer_number} is not a MoE layer of moe_layer_freq={config.moe_layer_freq}")
            router.router_replay = _RouterChoice(self, moe_layers.index(layer), f"decoder layer {router.layer_number} router")

    def recomputes(self, model: torch.nn.Module) -> bool:
        granularity = getattr(self.config, "recompute_granularity", None)
        modules = getattr(self.config, "recompute_modules", None) or ()
        recompute = granularity == "full" or (granularity == "selective" and "moe" in modules)
        return bool(recompute and torch.is_grad_enabled() and model.training)


class _RouterChoice:
    """What megatron-core calls as ``router.router_replay``."""

    def __init__(self, owner: MegatronRouterReplay, column: int, where: str) -> None:
        self.owner, self.column, self.where = owner, column, where

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None, default_compute_topk: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        own_values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        chosen = self.owner.choose(self.column, own, self.where)
        if chosen is None:
            return own_values, own
        experts, recorded = chosen
        values = torch.where(recorded[:, None], scores.gather(1, experts), own_values)
        return values, experts
