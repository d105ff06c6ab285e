"""Start engines for the benchmark and the tests: the registered ``embedded`` engine, as child
processes of the kernel's :class:`~miles.executor.local.LocalExecutor` (logs, health wait, no
orphans), on free loopback ports."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineLaunch:
    """One engine to start: device, dtype, extra environment (``CUDA_VISIBLE_DEVICES``) and engine
    options (keys of the ``engine`` config section, e.g. ``kv_cache_gb``)."""

    device: str = "cpu"
    dtype: str = "auto"
    env: Mapping[str, str] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RunningEngines:
    """Base URLs of the started engines, in launch order, and a way to restart one."""

    urls: list[str]
    executor: Any  # miles.executor.local.LocalExecutor

    def restart(self, index: int) -> None:
        """Stop engine ``index`` and start it again on the same port (a new process)."""
        self.executor.restart(f"engine-{index}")


@contextmanager
def running_engines(model_path: str | Path, launches: list[EngineLaunch], work_dir: Path, *,
                    engine: str = "embedded", startup_timeout: float = 600.0,
                    weight_dirs: Sequence[str | Path] = ()) -> Iterator[RunningEngines]:
    """Start one engine per launch, in order; stop them all on exit. Disk updates may read
    ``work_dir`` and ``weight_dirs``; the engines share this process's run token."""
    from miles_contracts.wire.auth import ensure_run_token

    ensure_run_token()
    from miles.executor.local import LocalExecutor, free_port
    from miles.kernel import Kernel
    from miles_contracts import EngineSpec

    server = Kernel.load().inference_engines().get(engine)
    executor = LocalExecutor(work_dir, startup_timeout=startup_timeout)
    urls = []
    try:
        for index, launch in enumerate(launches):
            spec = EngineSpec(str(model_path), free_port(), device=launch.device, dtype=launch.dtype,
                              options=dict(launch.options),
                              weight_dirs=[str(Path(d).resolve()) for d in (work_dir, *weight_dirs)])
            executor.start(f"engine-{index}", server.command(spec), health_url=f"{spec.url}/health", env=launch.env)
            urls.append(spec.url)
        yield RunningEngines(urls, executor)
    finally:
        executor.shutdown()
