"""Start engines for the benchmark and the tests: the registered ``embedded`` engine service, as
child processes of the kernel's :class:`~miles.executor.local.LocalExecutor` (logs, health wait,
no orphans), on free loopback ports.

Each engine is started as a run starts one: its service's ``command`` with a
:class:`~miles_contracts.ServiceLaunch` whose ``config_path`` is a config file written to
``work_dir`` (``engine-<i>.yaml``: the launch's model device and dtype and its options as the
engine's config section), which the engine process reads its settings from.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles.kernel import Kernel


@dataclass(frozen=True, slots=True)
class EngineLaunch:
    """One engine to start: device, dtype, extra environment (``CUDA_VISIBLE_DEVICES``), engine
    options (keys of the ``engine`` config section, e.g. ``kv_cache_gb``) and the LoRA adapters
    it serves (``train.lora`` of a run, as a mapping of :class:`miles_contracts.LoRASpec`'s keys)."""

    device: str = "cpu"
    dtype: str = "auto"
    env: Mapping[str, str] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
    lora: Mapping[str, Any] | None = None


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
                    weight_dirs: Sequence[str | Path] = (), kernel: Kernel | None = None,
                    together: bool = False) -> Iterator[RunningEngines]:
    """Start one engine per launch, in order; stop them all on exit. Disk updates may read
    ``work_dir`` (the run folder the engines are given) and ``weight_dirs`` (given to engines whose
    section has a ``weight_dir`` option, as the embedded engine's has); the engines share this
    process's run token.

    :param kernel: the kernel whose ``engine`` service and config sections to use (default: the
        one for the default plugin selection); the engine processes load theirs from the config
        files, for the same selection.
    :param together: start every engine before waiting for the first to be healthy, so that their
        start-ups overlap (default: each healthy before the next starts, so that engines sharing a
        GPU do not race for its memory while they start).
    """
    from miles.config import build_config
    from miles.context import context_for
    from miles.executor.local import LocalExecutor
    from miles.sections import CORE_SECTIONS
    from miles_contracts import ServiceLaunch
    from miles_contracts.wire.auth import ensure_run_token

    ensure_run_token()
    kernel = kernel if kernel is not None else context_for().kernel
    server = kernel.services().get(engine)
    # the engine's options are keys of its own config section (``engine``; ``sglang`` for SGLang):
    # the one it reads that is not the kernel's (``model``, ``run``)
    section = next(name for name in server.config_sections if name not in CORE_SECTIONS)
    section_model = kernel.config_sections().get(section).model
    work_dir.mkdir(parents=True, exist_ok=True)
    executor = LocalExecutor(work_dir, startup_timeout=startup_timeout)
    names = [f"engine-{index}" for index in range(len(launches))]
    urls = []
    try:
        for index, launch in enumerate(launches):
            sections = {"model": {"device": launch.device, "dtype": launch.dtype},
                        section: _options(launch.options, section_model, weight_dirs)}
            if launch.lora is not None:
                sections["train"] = {"lora": dict(launch.lora)}
            config = build_config(sections, kernel=kernel)
            config_path = work_dir.resolve() / f"engine-{index}.yaml"
            config_path.write_text(config.to_yaml())

            def command(endpoint, config=config, config_path=config_path):
                return server.command(ServiceLaunch(config, str(config_path), str(model_path), endpoint,
                                                    run_dir=str(work_dir.resolve())))

            name = names[index]
            executor.launch(name, command, health_path=server.health_path, env=launch.env)
            if not together:
                executor.wait_healthy(name)
        for name in names:
            if together:
                executor.wait_healthy(name)
            urls.append(executor.endpoint(name).url)  # after the wait: a start-up may move to another port
        yield RunningEngines(urls, executor)
    finally:
        executor.shutdown()


def _options(options: Mapping[str, Any], section_model: Any, weight_dirs: Sequence[str | Path]) -> dict[str, Any]:
    out = dict(options)
    if weight_dirs and "weight_dir" in section_model.model_fields:
        out["weight_dir"] = [*out.get("weight_dir", []), *(str(Path(d).resolve()) for d in weight_dirs)]
    return out
