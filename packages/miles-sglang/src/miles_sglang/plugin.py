"""Plugin ``sglang``: the ``sglang`` inference engine and the ``sglang`` config section."""

from __future__ import annotations

from miles import hookimpl
from miles.registry import Register
from miles_contracts import ConfigSectionSpec, ServiceSpec


@hookimpl
def miles_register_services(register: Register[ServiceSpec]) -> None:
    from miles_sglang.launch import SGLANG_SERVICE

    register("sglang", SGLANG_SERVICE)


@hookimpl
def miles_register_config_sections(register: Register[ConfigSectionSpec]) -> None:
    from miles_sglang.settings import SGLangSection

    register("sglang", ConfigSectionSpec(SGLangSection))
