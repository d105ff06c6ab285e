"""`RunContext`: what every plugin factory is given -- the run's config, its kernel, its folder,
and which process of the run is asking.

A run is several processes (docs/design/process-model.md): the **driver** (``miles train``: data,
rollout, rewards, advantages), N **trainer ranks**, and **services** (engines, the router, the
session server), each started from the run's resolved config. A factory (a train backend, a weight
transport, a data source, a router middleware ...) receives the context of the process it runs in,
so it never has to rebuild a kernel from the environment: the kernel it gets was loaded with the
run's own ``plugins.enable`` / ``plugins.disable``.

``config`` and ``kernel`` are the kernel's own types (``miles.config.MilesConfig``,
``miles.kernel.Kernel``); this module names them for type checkers only and imports nothing of
the kernel at run time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from miles.config import MilesConfig
    from miles.kernel import Kernel

ProcessKind = Literal["driver", "trainer-rank", "service", "cli"]
"""``driver``: the process of ``miles train``; ``trainer-rank``: one rank of the train backend;
``service``: an engine, the router, the session server ... (``role`` says which); ``cli``: a
``miles`` command that is not a run (``miles bench ...``, ``miles serve ...`` started by hand is a
``service``)."""


@dataclass(frozen=True, slots=True)
class Process:
    """Which process of a run this is.

    :ivar kind: see :data:`ProcessKind`.
    :ivar rank: the trainer rank (``trainer-rank`` only).
    :ivar role: the service's role, ``engine`` / ``router`` / ``session`` ... (``service`` only).
    """

    kind: ProcessKind
    rank: int | None = None
    role: str | None = None

    def __post_init__(self) -> None:
        if (self.kind == "trainer-rank") != (self.rank is not None):
            raise ValueError(f"a {self.kind} process {'needs' if self.kind == 'trainer-rank' else 'has no'} rank")
        if (self.kind == "service") != (self.role is not None):
            raise ValueError(f"a {self.kind} process {'needs' if self.kind == 'service' else 'has no'} role")

    @classmethod
    def driver(cls) -> Process:
        return cls("driver")

    @classmethod
    def trainer_rank(cls, rank: int) -> Process:
        return cls("trainer-rank", rank=rank)

    @classmethod
    def service(cls, role: str) -> Process:
        return cls("service", role=role)

    @classmethod
    def cli(cls) -> Process:
        return cls("cli")

    def __str__(self) -> str:
        if self.kind == "trainer-rank":
            return f"trainer rank {self.rank}"
        if self.kind == "service":
            return f"{self.role} service"
        return self.kind


@dataclass(frozen=True, slots=True)
class RunContext:
    """The run as one process of it sees it.

    :ivar config: the run's validated config (a ``miles`` command outside a run gets the defaults,
        or the config its arguments name).
    :ivar kernel: the plugins this process loaded, for the run's plugin selection.
    :ivar process: which process this is.
    :ivar run_dir: the run's folder (``runs/<name>``); None outside a run (a benchmark, a server
        started by hand without a run folder).
    """

    config: MilesConfig
    kernel: Kernel
    process: Process
    run_dir: Path | None = None

    def with_config(self, config: MilesConfig) -> RunContext:
        """The same process and kernel with another config (a command that read its own file)."""
        return replace(self, config=config)

    def require_run_dir(self, purpose: str) -> Path:
        """The run folder, or a clear error naming what needed it."""
        if self.run_dir is None:
            raise ValueError(f"{purpose} needs a run folder, but this {self.process} runs outside a run")
        return self.run_dir


__all__ = ["Process", "ProcessKind", "RunContext"]
