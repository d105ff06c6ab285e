"""Plugin ``weights``: the ``disk``, ``shared_memory``, ``broadcast`` and ``sglang_lora`` weight transports, the
``weight_transport`` config section, and the ``miles bench weights`` and ``miles weights cleanup`` commands.

Transports are imported inside their factories, so loading this plugin costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles import hookimpl
from miles.registry import Register
from miles_contracts import CommandSpec, ConfigSectionSpec, RunContext, WeightTransportSpec

from miles_weights.settings import WeightTransportSection

if TYPE_CHECKING:
    from miles_contracts import WeightTransport


def disk(ctx: RunContext) -> WeightTransport:
    from miles_weights.disk import DiskTransport

    return DiskTransport.from_context(ctx)


def shared_memory(ctx: RunContext) -> WeightTransport:
    from miles_weights.shared_memory import SharedMemoryTransport

    return SharedMemoryTransport.from_context(ctx)


def broadcast(ctx: RunContext) -> WeightTransport:
    from miles_weights.broadcast import BroadcastTransport

    return BroadcastTransport.from_context(ctx)


def sglang_lora(ctx: RunContext) -> WeightTransport:
    from miles_weights.adapters import SGLangAdapterTransport

    return SGLangAdapterTransport.from_context(ctx)


@hookimpl
def miles_register_weight_transports(register: Register[WeightTransportSpec]) -> None:
    register("disk", WeightTransportSpec(disk))
    # CUDA IPC: an engine opens the trainer's GPU memory, so with GPUs it must sit on that GPU
    # (a colocated placement); the run refuses a disaggregated one before anything starts
    register("shared_memory", WeightTransportSpec(shared_memory, needs_shared_gpu=True))
    register("broadcast", WeightTransportSpec(broadcast))
    # train.lora on SGLang engines: adapters as a PEFT folder SGLang loads by name (miles_weights.adapters)
    register("sglang_lora", WeightTransportSpec(sglang_lora))


@hookimpl
def miles_register_config_sections(register: Register[ConfigSectionSpec]) -> None:
    register("weight_transport", ConfigSectionSpec(WeightTransportSection))


def _cleanup(args: object, ctx: RunContext) -> int:
    from miles_contracts.wire.tensors import remove_stale_shm_files, shm_dir

    removed = remove_stale_shm_files()
    for path in removed:
        print(f"removed {path}")
    print(f"{len(removed)} shared-memory weight file(s) of processes that are gone removed from {shm_dir()}")
    return 0


@hookimpl
def miles_register_commands(register: Register[CommandSpec]) -> None:
    from miles_weights.bench import add_arguments, run

    register("bench weights", CommandSpec(
        "GB/s of a full weight sync trainer -> engine per transport, against a memory copy",
        run, add_arguments=add_arguments,
    ))
    register("weights cleanup", CommandSpec(
        "remove /dev/shm weight buckets left by runs that were killed (their process is gone)", _cleanup,
    ))
