"""Where a run's processes live: nodes, endpoints, and the services packages declare.

An executor (``local``, ``ray``) offers :class:`Node` s and starts processes on them; a package
that provides a long-running server (an inference engine, the router, the session server)
registers a :class:`~miles_contracts.specs.ServiceSpec` through ``miles_register_services`` saying
how to start it and how to tell it is healthy. The kernel decides which services a run needs and where (placement), and asks
the executor to start them: no executor knows a package, no package knows an executor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles.config import MilesConfig

ENGINE = "engine"
"""Role of inference engines: ``rollout.engine`` picks the service, ``resources`` places them."""
ROUTER = "router"
"""Role of the service generators talk to: it spreads requests over the engines."""
SESSION = "session"
"""Role of the session server; its URL reaches generators as ``GenerateContext.session_server_url``."""

EXIT_ADDRESS_IN_USE = 98
"""Exit status of a service that could not listen on the port its endpoint names (another process
took it between the executor's choice and the bind; 98 is Linux's ``EADDRINUSE``). An executor
starts a service that exits with it during start-up again, on a port it picks anew."""


@dataclass(frozen=True, slots=True)
class Node:
    """A machine the run can place processes on.

    :ivar name: the executor's id for it (``local``; a Ray node id).
    :ivar address: the host other nodes reach its services at.
    :ivar gpus: ids of the GPUs the run may use there (values of ``CUDA_VISIBLE_DEVICES``), in id
        order; empty on a CPU-only node.
    """

    name: str
    address: str
    gpus: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a started process listens (the executor picked a free port on its node)."""

    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class ServiceLaunch:
    """What one instance of a service is started with (built by the driver, again on every restart).

    A service process reads the run's settings from ``config_path`` (the run folder's resolved
    ``config.yaml``; it loads the kernel for the run's ``plugins`` section from it), so argv
    carries only what the launch decides: the endpoint, the resolved model, the upstream URLs.

    :ivar config: the run's ``MilesConfig``, for what ``command`` itself decides (SGLang's flags,
        whether the instance fits its GPUs).
    :ivar config_path: the run's resolved config file, for the process (``--config``).
    :ivar model_path: local folder of the run's model.
    :ivar endpoint: host and port the process must listen on.
    :ivar upstream: base URLs of the services it may depend on, by role (``{"engine": [...]}``).
    :ivar index: which instance of its role this is (``engine-3`` has index 3).
    :ivar gpus: number of GPUs the process sees (``CUDA_VISIBLE_DEVICES`` is set by the executor);
        an engine shards over all of them. 0 on CPU.
    :ivar run_dir: the run's folder (the disk weight transport writes there, so engines must be
        allowed to load from it); empty outside a run.
    """

    config: MilesConfig
    config_path: str
    model_path: str
    endpoint: Endpoint
    upstream: Mapping[str, Sequence[str]] = field(default_factory=dict)
    index: int = 0
    gpus: int = 0
    run_dir: str = ""


__all__ = ["ENGINE", "EXIT_ADDRESS_IN_USE", "ROUTER", "SESSION", "Endpoint", "Node", "ServiceLaunch"]
