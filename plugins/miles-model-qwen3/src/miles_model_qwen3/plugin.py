"""Miles plugin ``qwen3`` (distribution miles-model-qwen3): hook implementations.

Kept light: ``miles plugins`` imports this module, so families and bridges are built on demand.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles import hookimpl
from miles.registry import Register
from miles_contracts.chat import ChatFamily


@hookimpl
def miles_register_chat_families(register: Register[ChatFamily]) -> None:
    """The Qwen3 family for TITO sessions (``tito.family: qwen3``): fixed template, hermes tool calls."""
    from miles_model_qwen3.chat import qwen3_family

    register("qwen3", qwen3_family())


@hookimpl
def miles_model_bridge(hf_config: Mapping[str, Any]) -> Any:
    """Claim ``Qwen3ForCausalLM`` and ``Qwen3MoeForCausalLM`` checkpoints (by ``architectures``,
    then ``model_type``) with the HF <-> megatron-core weight bridge."""
    from miles_model_qwen3.bridge import Qwen3Bridge

    return Qwen3Bridge() if Qwen3Bridge.claims(hf_config) else None
