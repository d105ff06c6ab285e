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


def layer_map_of(bridge: ModelBridge | None, hf_config: Mapping[str, Any], *,
                 install_hint: str | None = None) -> MoeLayerMap | None:
    """The bridge's map for ``hf_config`` (None for a dense model). A model whose config names
    experts but whose bridge gives no map is an error: replaying it is impossible, skipping it silent.

    :param install_hint: which package's plugin claims this architecture, when it is not loaded
        (``Kernel.install_state.model_hint``), for the error."""
    moe_layers = getattr(bridge, "moe_layers", None)
    if moe_layers is not None:
        return moe_layers(hf_config)
    experts = hf_config.get("num_experts") or hf_config.get("num_local_experts") or hf_config.get("n_routed_experts")
    if experts:
        arch = hf_config.get("architectures") or hf_config.get("model_type")
        owner = f"bridge {bridge.name!r}" if bridge is not None else "no model bridge (no plugin claims it)"
        fix = install_hint or "install the model's plugin or add moe_layers to its bridge"
        raise MilesError(f"routing replay needs the MoE layer map of {arch}, but it has {owner} with moe_layers(); {fix}")
    return None


def layer_map_of_run(config: MilesConfig, kernel: Kernel) -> MoeLayerMap | None:
    """The map of the run's model (``model.name``), from its ``config.json``."""
    folder = kernel.resolve_model(config.model.name)
    hf_config = json.loads((folder / "config.json").read_text())
    names = [*(hf_config.get("architectures") or ()), *([hf_config["model_type"]] if hf_config.get("model_type") else [])]
    return layer_map_of(kernel.find_model_bridge(hf_config), hf_config,
                        install_hint=kernel.install_state.model_hint([str(n) for n in names]))
