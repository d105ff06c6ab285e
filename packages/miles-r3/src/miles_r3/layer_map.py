"""Finding a model's :class:`~miles_contracts.MoeLayerMap`: its model bridge says (model plugins
own model-family knowledge; nothing here guesses from module names)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from miles.errors import MilesError
from miles_contracts import ModelBridge, MoeLayerMap

if TYPE_CHECKING:
    from miles.config import MilesConfig
    from miles.kernel import Kernel


def layer_map_of(bridge: ModelBridge | None, hf_config: Mapping[str, Any]) -> MoeLayerMap | None:
    """The bridge's map for ``hf_config`` (None for a dense model). A model whose config names
    experts but whose bridge gives no map is an error: replaying it is impossible, skipping it silent."""
    moe_layers = getattr(bridge, "moe_layers", None)
    if moe_layers is not None:
        return moe_layers(hf_config)
    experts = hf_config.get("num_experts") or hf_config.get("num_local_experts") or hf_config.get("n_routed_experts")
    if experts:
        arch = hf_config.get("architectures") or hf_config.get("model_type")
        owner = f"bridge {bridge.name!r}" if bridge is not None else "no model bridge (no plugin claims it)"
        raise MilesError(f"routing replay needs the MoE layer map of {arch}, but it has {owner} with moe_layers(); "
                         f"install the model's plugin or add moe_layers to its bridge")
    return None


def layer_map_of_run(config: MilesConfig, kernel: Kernel) -> MoeLayerMap | None:
    """The map of the run's model (``model.name``), from its ``config.json``."""
    folder = kernel.resolve_model(config.model.name)
    hf_config = json.loads((folder / "config.json").read_text())
    return layer_map_of(kernel.find_model_bridge(hf_config), hf_config)
