"""Miles plugin ``acme``: hook implementations (kept light: ``miles plugins`` imports this)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from miles import hookimpl
from miles.registry import Register

from acme_miles.bridge import MistralBridge
from acme_miles.reward import CONCISE, ConciseSection

if TYPE_CHECKING:
    from miles.config import MilesConfig


@hookimpl
def miles_model_bridge(hf_config: Mapping[str, Any]) -> MistralBridge | None:
    return MistralBridge() if MistralBridge.claims(hf_config) else None


@hookimpl
def miles_register_rewards(register: Register) -> None:
    register("concise", CONCISE)


@hookimpl
def miles_register_config_sections(register: Register) -> None:
    register("concise", ConciseSection)


@hookimpl
def miles_configure(config: MilesConfig) -> None:
    CONCISE.max_words = config.section("concise", ConciseSection).max_words
