"""Building a :class:`~miles_contracts.RunContext`: what each process's entry point does once.

Every process of a run starts from the run's config (the driver from the user's, trainer ranks
and services from the run folder's resolved copy), loads the kernel for its ``plugins`` section,
calls ``miles_configure`` and hands the context to every factory it calls. Plugins never build
one: they are given it.
"""

from __future__ import annotations

from pathlib import Path

from miles_contracts import Process, RunContext

from miles.config import MilesConfig, load_config
from miles.kernel import Kernel


def context_for(config: MilesConfig | None = None, process: Process | None = None, *, run_dir: Path | None = None,
                kernel: Kernel | None = None, configure: bool = False) -> RunContext:
    """The context of ``process`` (default: a ``cli`` process) for ``config`` (default: the defaults).

    :param kernel: the kernel to use; default the one for ``config``'s plugin selection.
    :param configure: call ``miles_configure`` in this process (entry points of a run's processes do).
    """
    config = config if config is not None else MilesConfig()
    kernel = kernel if kernel is not None else Kernel.load(config.plugin_selection)
    ctx = RunContext(config, kernel, process or Process.cli(), run_dir)
    if configure:
        kernel.configure(ctx)
    return ctx


def service_context(config_path: str | Path | None, role: str, overrides: list[str] | None = None, *,
                    run_dir: Path | None = None) -> RunContext:
    """The context of a service process: the config file (``--config``; a run passes its folder's
    resolved ``config.yaml``; None: the defaults) loaded and validated with ``overrides`` (the
    process's own flags, as ``section.key=value``), the kernel for that config's plugin selection,
    ``miles_configure`` called.

    :param run_dir: the run's folder, when the service belongs to a run.
    """
    # the driver checked the run's names against every registry; this process resolves its own
    config = load_config(Path(config_path) if config_path is not None else None, overrides or [], check_names=False)
    return context_for(config, Process.service(role), run_dir=run_dir, configure=True)


__all__ = ["context_for", "service_context"]
