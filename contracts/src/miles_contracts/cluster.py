"""Where a run's processes live: nodes, endpoints, and the services packages declare.

An executor (``local``, ``ray``) offers :class:`Node` s and starts processes on them; a package
that provides a long-running server (an inference engine, the router, the session server)
registers a :class:`Service` through ``miles_register_services`` saying how to start it and how to
tell it is healthy. The kernel decides which services a run needs and where (placement), and asks
the executor to start them: no executor knows a package, no package knows an executor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

ENGINE = "engine"
"""Role of inference engines: ``rollout.engine`` picks the service, ``resources`` places them."""
ROUTER = "router"
"""Role of the service generators talk to: it spreads requests over the engines."""
SESSION = "session"
"""Role of the session server; its URL reaches generators as ``GenerateContext.session_server_url``."""


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
    """What one instance of a service is started with.

    :ivar config: the run's ``MilesConfig`` (a service reads its own sections from it).
    :ivar model_path: local folder of the run's model.
    :ivar endpoint: host and port the process must listen on.
    :ivar upstream: base URLs of the services it may depend on, by role (``{"engine": [...]}``).
    :ivar index: which instance of its role this is (``engine-3`` has index 3).
    :ivar gpus: number of GPUs the process sees (``CUDA_VISIBLE_DEVICES`` is set by the executor);
        an engine shards over all of them. 0 on CPU.
    :ivar run_dir: the run's folder (the disk weight transport writes there, so engines must be
        allowed to load from it); empty outside a run.
    """

    config: Any
    model_path: str
    endpoint: Endpoint
    upstream: Mapping[str, Sequence[str]] = field(default_factory=dict)
    index: int = 0
    gpus: int = 0
    run_dir: str = ""


@runtime_checkable
class Service(Protocol):
    """A long-running server a package provides, registered with ``miles_register_services``.

    :cvar role: what it is to the run: ``engine`` (chosen by ``rollout.engine``, placed on GPUs by
        ``resources``), ``router`` (always started, in front of the engines) or another role a
        generator asks for through its ``services`` attribute (``session``): a registered generator
        with ``services = ("session",)`` makes every run that uses it start the session service.
    :cvar needs: roles whose URLs it must be given (started before it).
    :cvar health_path: ``GET`` path that answers 200 once it serves (None: no health check).
    :cvar config_sections: config sections it reads (listed in ``<run>/services.json``).
    """

    role: ClassVar[str]
    needs: ClassVar[tuple[str, ...]]
    health_path: ClassVar[str | None]
    config_sections: ClassVar[tuple[str, ...]]

    def command(self, launch: ServiceLaunch) -> list[str]:
        """argv of the process that serves this instance on ``launch.endpoint``."""
        ...


class UpstreamAware(Protocol):
    """Optional for a :class:`Service`: follow an upstream service that moved (an engine restarted
    on another node) without a restart. Without it, the kernel restarts the service."""

    def upstream_moved(self, url: str, role: str, old: str, new: str) -> None:
        """Tell the instance at ``url`` that its ``role`` upstream ``old`` is now at ``new``."""
        ...


__all__ = ["ENGINE", "ROUTER", "SESSION", "Endpoint", "Node", "Service", "ServiceLaunch", "UpstreamAware"]
