"""Plugin ``sglang``: the ``sglang`` inference engine and the ``sglang`` config section."""

from __future__ import annotations

from miles import hookimpl
from miles.registry import Register


@hookimpl
def miles_register_inference_engines(register: Register) -> None:
    from miles_sglang.launch import SGLangEngine

    register("sglang", SGLangEngine())


@hookimpl
def miles_register_config_sections(register: Register) -> None:
    from miles_sglang.settings import SGLangSection

    register("sglang", SGLangSection)
