"""Built-in plugin ``executors``: the ``local`` executor (child processes on this machine)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles_contracts import ExecutorSpec, RunContext

from miles.hookspecs import hookimpl
from miles.registry import Register

if TYPE_CHECKING:
    from miles_contracts import Executor


def local_executor(ctx: RunContext) -> Executor:
    from miles.executor.local import LocalExecutor, local_gpus

    config = ctx.config
    run_dir = ctx.require_run_dir("the local executor (its process logs)")
    gpus = None
    per_node = config.resources.gpus_per_node
    if per_node is not None:  # the config says how many; prefer the ids this machine shows
        shown = local_gpus()
        gpus = list(shown[:per_node]) if len(shown) >= per_node else [str(i) for i in range(per_node)]
    return LocalExecutor(run_dir, startup_timeout=config.executor.startup_timeout, gpus=gpus)


@hookimpl
def miles_register_executors(register: Register[ExecutorSpec]) -> None:
    register("local", ExecutorSpec(local_executor))
