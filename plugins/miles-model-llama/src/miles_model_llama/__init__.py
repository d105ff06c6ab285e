"""Miles model plugin for Llama-architecture models (SmolLM2, Llama 3): the HF <-> megatron-core
weight bridge. The template a third party copies to publish a bridge (see README.md)."""

from miles_model_llama.bridge import LlamaBridge, architecture_matches
from miles_model_llama.layout import LOCAL, TRANSFORMER_ENGINE, MegatronLayout
from miles_model_llama.mapping import BridgeError, Rule, WeightMap

__all__ = [
    "LOCAL",
    "TRANSFORMER_ENGINE",
    "BridgeError",
    "LlamaBridge",
    "MegatronLayout",
    "Rule",
    "WeightMap",
    "architecture_matches",
]
