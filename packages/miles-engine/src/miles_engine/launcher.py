"""The ``embedded`` inference engine as a run sees it: how to start one server process.

:class:`EmbeddedEngine` turns an :class:`~miles_contracts.EngineSpec` into the argv of
``python -m miles_engine``; :data:`ENGINE_SERVICE` is what this package registers through
``miles_register_services`` (role ``engine``): the spec from the run's ``model`` and ``engine``
sections and the endpoint the executor picked.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from miles_contracts import ServiceSpec
from miles_contracts.cluster import ENGINE

from miles_engine.options import options_argv

if TYPE_CHECKING:
    from miles_contracts import EngineSpec, ServiceLaunch


class EmbeddedEngine:
    """``command(spec)`` is the argv of ``python -m miles_engine`` serving ``spec``.

    ``spec.options`` takes the keys of the ``engine`` config section (``max_running_requests``,
    ``context_length`` ...); ``spec.model_path`` may be a folder or a name of ``miles models list``;
    ``spec.deterministic`` is ``--enable-deterministic-inference``.
    """

    config_section = "engine"

    def command(self, spec: EngineSpec) -> list[str]:
        return [
            sys.executable, "-m", "miles_engine",
            "--model", str(spec.model_path), "--host", spec.host, "--port", str(spec.port),
            "--device", spec.device, "--dtype", spec.dtype,
            *options_argv({**spec.options, "enable_deterministic_inference": spec.deterministic}),
            *[part for folder in spec.weight_dirs for part in ("--weight-dir", str(folder))],
        ]


def engine_command(launch: ServiceLaunch) -> list[str]:
    """argv of the embedded engine serving one instance of a run (service ``embedded``). It runs on
    the one device it sees (``CUDA_VISIBLE_DEVICES`` holds its GPU); it does not shard, so it
    takes one GPU per engine."""
    from miles_contracts import EngineSpec

    from miles_engine.options import EngineSection

    if launch.gpus > 1:
        raise ValueError(f"the embedded engine runs on one GPU, but resources.gpus_per_engine gives it {launch.gpus}; "
                         f"set resources.gpus_per_engine=1 (or use an engine that shards, e.g. sglang)")
    config = launch.config
    options = config.section("engine", EngineSection).options()
    spec = EngineSpec(model_path=launch.model_path, port=launch.endpoint.port, host=launch.endpoint.host,
                      device=config.model.device, dtype=config.model.dtype, options=options,
                      deterministic=config.run.deterministic,
                      weight_dirs=[launch.run_dir] if launch.run_dir else [])
    return EmbeddedEngine().command(spec)


ENGINE_SERVICE = ServiceSpec(ENGINE, engine_command, config_sections=("model", "engine"))
"""What this package registers as service ``embedded``."""
