"""The ``embedded`` inference engine as a run sees it: how to start one server process.

:data:`ENGINE_SERVICE` is what this package registers through ``miles_register_services`` (role
``engine``). Its command is ``python -m miles_engine --config <run>/config.yaml`` plus what the
launch decides -- the resolved model folder, the endpoint the executor picked, the run's folder;
the process reads everything else (the ``engine`` section, ``model.device`` / ``model.dtype``,
``run.deterministic``, the ``plugins`` selection) from the config file.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from miles_contracts import ServiceSpec
from miles_contracts.cluster import ENGINE

if TYPE_CHECKING:
    from miles_contracts import ServiceLaunch


def engine_argv(model_path: str, *, port: int, host: str = "127.0.0.1", config_path: str | None = None,
                run_dir: str | None = None, extra: Sequence[str] = (), python: str | None = None) -> list[str]:
    """argv of ``python -m miles_engine`` serving ``model_path`` on ``host:port``, reading its settings
    from ``config_path`` (None: the defaults), with ``extra`` flags on top (``--device cpu``, ...)."""
    argv = [python or sys.executable, "-m", "miles_engine", "--model", str(model_path), "--host", host,
            "--port", str(port)]
    if config_path:
        argv += ["--config", str(config_path)]
    if run_dir:
        argv += ["--run-dir", str(run_dir)]
    return [*argv, *extra]


def engine_command(launch: ServiceLaunch) -> list[str]:
    """argv of the embedded engine serving one instance of a run (service ``embedded``). It runs on
    the one device it sees (``CUDA_VISIBLE_DEVICES`` holds its GPU); it does not shard, so it
    takes one GPU per engine."""
    if launch.gpus > 1:
        raise ValueError(f"the embedded engine runs on one GPU, but resources.gpus_per_engine gives it {launch.gpus}; "
                         f"set resources.gpus_per_engine=1 (or use an engine that shards, e.g. sglang)")
    return engine_argv(launch.model_path, port=launch.endpoint.port, host=launch.endpoint.host,
                       config_path=launch.config_path, run_dir=launch.run_dir or None)


ENGINE_SERVICE = ServiceSpec(ENGINE, engine_command, config_sections=("model", "run", "rollout", "engine"))
"""What this package registers as service ``embedded``."""
