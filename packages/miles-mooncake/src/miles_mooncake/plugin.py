"""Plugin ``mooncake``: the ``mooncake`` weight transport and its config section. Mooncake itself is
imported when a transport starts, so loading this plugin costs nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles import hookimpl
from miles.registry import Register
from miles_contracts import ConfigSectionSpec, RunContext, WeightTransportSpec

if TYPE_CHECKING:
    from miles_contracts import WeightTransport


def mooncake(ctx: RunContext) -> WeightTransport:
    from miles_mooncake.transport import MooncakeTransport

    return MooncakeTransport.from_context(ctx)


@hookimpl
def miles_register_weight_transports(register: Register[WeightTransportSpec]) -> None:
    register("mooncake", WeightTransportSpec(mooncake))


@hookimpl
def miles_register_config_sections(register: Register[ConfigSectionSpec]) -> None:
    from miles_mooncake.settings import MooncakeSection

    register("mooncake", ConfigSectionSpec(MooncakeSection))
