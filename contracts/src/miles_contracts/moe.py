"""`MoeLayerMap`: where a mixture-of-experts model routes, as its model plugin describes it.

Routing replay (``miles-r3``) and anything else that reads or forces expert choices needs four
facts a model family knows and nothing else should guess: which decoder layers are MoE layers,
where each layer's router module sits in the Hugging Face model, how many experts a token goes to,
and how a router turns its logits into the weights of the chosen experts. A model bridge returns
one from :meth:`miles_contracts.ModelBridge.moe_layers` (None for a dense model).

Layer numbering is the Hugging Face one: 0-based over all decoder layers. An engine reporting
routed experts the way SGLang does (``meta_info.routed_experts``) reports ``num_layers`` layers,
dense ones included (zeros there); :attr:`moe_layers` picks the MoE ones out of those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Scoring = Literal["softmax", "sigmoid"]


@dataclass(frozen=True, slots=True)
class MoeLayerMap:
    """The MoE layout of one model.

    :ivar num_layers: decoder layers in all (dense and MoE).
    :ivar moe_layers: 0-based indices of the MoE layers, ascending.
    :ivar num_experts: routed experts per MoE layer.
    :ivar top_k: experts each token goes to.
    :ivar hf_router: path of a layer's router module in the HF model, with ``{layer}`` for the
        layer index (Qwen3-MoE: ``"model.layers.{layer}.mlp.gate"``).
    :ivar scoring: how router logits become expert scores over all experts (``softmax`` or
        ``sigmoid``, taken in float32).
    :ivar normalize_top_k: the chosen experts' scores are divided by their sum.
    """

    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hf_router: str
    scoring: Scoring = "softmax"
    normalize_top_k: bool = True

    def __post_init__(self) -> None:
        problems = []
        if not self.moe_layers:
            problems.append("moe_layers is empty (a dense model has no map: return None)")
        if list(self.moe_layers) != sorted(set(self.moe_layers)):
            problems.append(f"moe_layers must be ascending and unique, got {list(self.moe_layers)}")
        if self.moe_layers and not 0 <= self.moe_layers[0] <= self.moe_layers[-1] < self.num_layers:
            problems.append(f"moe_layers {list(self.moe_layers)} must lie in [0, num_layers={self.num_layers})")
        if not 1 <= self.top_k <= self.num_experts:
            problems.append(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if "{layer}" not in self.hf_router:
            problems.append(f"hf_router must contain '{{layer}}', got {self.hf_router!r}")
        if problems:
            raise ValueError("invalid MoeLayerMap: " + "; ".join(problems))

    def router_path(self, layer: int) -> str:
        """The HF module path of ``layer``'s router."""
        return self.hf_router.format(layer=layer)
