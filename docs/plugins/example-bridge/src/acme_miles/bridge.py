"""Mistral <-> megatron-core. Mistral names and lays out its weights exactly like Llama, so the
bridge is miles-model-llama's weight table behind Mistral's own claim and config checks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from miles_model_llama import (
    TRANSFORMER_ENGINE,
    BridgeError,
    LlamaBridge,
    MegatronLayout,
    architecture_matches,
)

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class MistralBridge:
    layout: MegatronLayout = TRANSFORMER_ENGINE

    name: ClassVar[str] = "mistral"
    chat_family: ClassVar[str | None] = None

    @classmethod
    def claims(cls, hf_config: Mapping[str, Any]) -> bool:
        return architecture_matches(hf_config, frozenset({"MistralForCausalLM"}), frozenset({"mistral"}))

    def _llama(self, hf_config: Mapping[str, Any]) -> LlamaBridge:
        window = hf_config.get("sliding_window")
        if window is not None:
            raise BridgeError(
                f"sliding_window={window}: this bridge maps full-attention Mistral models only "
                f"(Mistral 7B v0.2+ and Mistral NeMo have sliding_window: null)"
            )
        return LlamaBridge(self.layout)

    def to_megatron(
        self, hf_state: Mapping[str, torch.Tensor], hf_config: Mapping[str, Any], *, partial: bool = False,
    ) -> dict[str, torch.Tensor]:
        return self._llama(hf_config).to_megatron(hf_state, hf_config, partial=partial)

    def to_hf(
        self, mcore_state: Mapping[str, torch.Tensor], hf_config: Mapping[str, Any], *, partial: bool = False,
    ) -> dict[str, torch.Tensor]:
        return self._llama(hf_config).to_hf(mcore_state, hf_config, partial=partial)

    def megatron_config(self, hf_config: Mapping[str, Any]) -> dict[str, Any]:
        return self._llama(hf_config).megatron_config(hf_config)
