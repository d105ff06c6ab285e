"""Plugin ``ray`` (distribution miles-ray): the ``ray`` executor and its ``ray`` config section.

Light: Ray is imported only when a run uses the executor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles import hookimpl
from miles.registry import Register
from miles_contracts import ConfigSectionSpec, ExecutorSpec, RunContext

if TYPE_CHECKING:
    from miles_contracts import Executor


def ray_executor(ctx: RunContext) -> Executor:
    from miles_ray.config import RaySection
    from miles_ray.executor import RayExecutor

    config = ctx.config
    return RayExecutor(config.section("ray", RaySection), ctx.require_run_dir("the ray executor (its logs)"),
                       startup_timeout=config.executor.startup_timeout)


@hookimpl
def miles_register_executors(register: Register[ExecutorSpec]) -> None:
    register("ray", ExecutorSpec(ray_executor))


@hookimpl
def miles_register_config_sections(register: Register[ConfigSectionSpec]) -> None:
    from miles_ray.config import RaySection

    register("ray", ConfigSectionSpec(RaySection))
