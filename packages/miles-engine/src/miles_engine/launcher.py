"""The ``embedded`` inference engine as the kernel sees it: how to start one server process."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from miles_engine.options import options_argv

if TYPE_CHECKING:
    from miles_contracts import EngineSpec


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
