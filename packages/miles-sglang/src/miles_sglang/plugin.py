"""Plugin ``sglang``: the ``sglang`` inference engine and the ``sglang`` config section."""

from __future__ import annotations

from miles import hookimpl
from miles.registry import Register


@hookimpl
def miles_register_services(register: Register) -> None:
    from miles_sglang.launch import SGLangService

    register("sglang", SGLangService())


@hookimpl
def miles_register_config_sections(register: Register) -> None:
    from miles_sglang.settings import SGLangSection

    register("sglang", SGLangSection)
