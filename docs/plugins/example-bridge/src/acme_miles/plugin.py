"""Miles plugin ``acme``: hook implementations (kept light: ``miles plugins`` imports this)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles import hookimpl
from miles.registry import Register
from miles_contracts import ConfigSectionSpec, RewardSpec

from acme_miles.bridge import MistralBridge
from acme_miles.reward import CONCISE, ConciseSection


@hookimpl
def miles_model_bridge(hf_config: Mapping[str, Any]) -> MistralBridge | None:
    return MistralBridge() if MistralBridge.claims(hf_config) else None


@hookimpl
def miles_register_rewards(register: Register[RewardSpec]) -> None:
    register("concise", CONCISE)


@hookimpl
def miles_register_config_sections(register: Register[ConfigSectionSpec]) -> None:
    register("concise", ConfigSectionSpec(ConciseSection))
