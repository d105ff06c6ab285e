"""Plugin ``sglang``: the ``sglang`` inference engine and the ``sglang`` config section."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles import hookimpl
from miles.registry import Register
from miles_contracts import ConfigSectionSpec, RunContext, ServiceSpec

if TYPE_CHECKING:
    from miles.config import MilesConfig


@hookimpl
def miles_register_services(register: Register[ServiceSpec]) -> None:
    from miles_sglang.launch import SGLANG_SERVICE

    register("sglang", SGLANG_SERVICE)


@hookimpl
def miles_register_config_sections(register: Register[ConfigSectionSpec]) -> None:
    from miles_sglang.settings import SGLangSection

    register("sglang", ConfigSectionSpec(SGLangSection))


@hookimpl
def miles_configure(config: MilesConfig, ctx: RunContext) -> None:
    """In the driver of a run on SGLang engines: refuse settings SGLang cannot serve, before
    anything starts."""
    if ctx.process.kind != "driver" or config.rollout.engine != "sglang":
        return
    from miles.errors import ConfigError

    from miles_sglang.settings import run_errors

    errors = run_errors(config)
    if errors:
        raise ConfigError(errors)
