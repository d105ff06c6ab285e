"""Plugin ``ray`` (distribution miles-ray): the ``ray`` executor and its ``ray`` config section.

Light: Ray is imported only when a run uses the executor.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from miles import hookimpl
from miles.registry import Register

if TYPE_CHECKING:
    from miles.config import MilesConfig
    from miles_contracts import Executor


def ray_executor(config: MilesConfig, run_dir: Path) -> Executor:
    from miles_ray.config import RaySection
    from miles_ray.executor import RayExecutor

    return RayExecutor(config.section("ray", RaySection), run_dir, startup_timeout=config.executor.startup_timeout)


@hookimpl
def miles_register_executors(register: Register) -> None:
    register("ray", ray_executor)


@hookimpl
def miles_register_config_sections(register: Register) -> None:
    from miles_ray.config import RaySection

    register("ray", RaySection)
