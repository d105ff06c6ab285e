"""Built-in plugin ``executors``: the ``local`` executor (child processes on this machine)."""

from __future__ import annotations

from pathlib import Path

from miles.config import MilesConfig
from miles.hookspecs import hookimpl
from miles.registry import Register


def local_executor(config: MilesConfig, run_dir: Path):
    from miles.executor.local import LocalExecutor

    return LocalExecutor(run_dir, startup_timeout=config.executor.startup_timeout)


@hookimpl
def miles_register_executors(register: Register) -> None:
    register("local", local_executor)
