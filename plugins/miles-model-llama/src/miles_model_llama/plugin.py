"""Miles plugin ``llama`` (distribution miles-model-llama): hook implementations.

Kept light: ``miles plugins`` imports this module, so nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles import hookimpl
from miles.registry import Register
from miles_contracts.chat import ChatFamily

from miles_model_llama.bridge import LlamaBridge


@hookimpl
def miles_model_bridge(hf_config: Mapping[str, Any]) -> LlamaBridge | None:
    """Claim ``LlamaForCausalLM`` checkpoints (decided by ``architectures``, then ``model_type``)."""
    return LlamaBridge() if LlamaBridge.claims(hf_config) else None


@hookimpl
def miles_register_chat_families(register: Register[ChatFamily]) -> None:
    """The ChatML family of SmolLM2 for TITO sessions (``tito.family: chatml``)."""
    from miles_model_llama.chat import chatml_family

    register("chatml", chatml_family())
