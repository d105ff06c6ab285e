"""Start the inference side of a run: engines, the router in front of them, a session server.

The executor owns the processes; this module decides what to start and wires the URLs. An engine
that dies is restarted by the supervisor (when ``executor.restart_engines``) and marked stale until
the next weight sync gives it the current weights; the router keeps it out of rotation meanwhile.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_contracts import EngineSpec

from miles.config import MilesConfig
from miles.executor.local import free_port
from miles.kernel import Kernel

HOST = "127.0.0.1"


@dataclass
class Services:
    """URLs of the running inference services."""

    executor: Any
    engine_urls: dict[str, str]  # service name -> base URL
    router_url: str
    session_url: str | None = None
    stale_engines: set[str] = field(default_factory=set)  # restarted, waiting for weights
    restarts: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def take_stale(self) -> list[str]:
        with self._lock:
            names = sorted(self.stale_engines)
            self.stale_engines.clear()
            return names

    def mark_stale(self, name: str) -> None:
        with self._lock:
            self.stale_engines.add(name)
            self.restarts += 1


def _miles_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "miles.cli.main", *args]


def start_services(config: MilesConfig, kernel: Kernel, model_path: Path, run_dir: Path) -> Services:
    executor = kernel.executors().get(config.executor.name)(config, run_dir)
    try:
        engine = kernel.inference_engines().get(config.rollout.engine)
        engine_urls = {}
        for i in range(config.rollout.num_engines):
            spec = EngineSpec(model_path=str(model_path), port=free_port(HOST), host=HOST,
                              device=config.model.device, dtype=config.model.dtype)
            name = f"engine-{i}"
            executor.start(name, engine.command(spec), health_url=f"{spec.url}/health")
            engine_urls[name] = spec.url

        router_port = free_port(HOST)
        router_argv = _miles_cli("serve", "router", "--host", HOST, "--port", str(router_port),
                                 "--health-interval", str(config.router.health_interval),
                                 "--failure-threshold", str(config.router.failure_threshold))
        for url in engine_urls.values():
            router_argv += ["--worker", url]
        for middleware in config.router.middlewares:
            router_argv += ["--middleware", middleware]
        router_url = f"http://{HOST}:{router_port}"
        executor.start("router", router_argv, health_url=f"{router_url}/health")

        session_url = None
        if config.rollout.generator == "agentic":
            port = free_port(HOST)
            session_url = f"http://{HOST}:{port}"
            executor.start("session", _miles_cli("serve", "session", "--host", HOST, "--port", str(port),
                                                 "--router", router_url, "--model", str(model_path)),
                           health_url=f"{session_url}/health")
    except BaseException:
        executor.shutdown()
        raise

    services = Services(executor, engine_urls, router_url, session_url)
    if config.executor.restart_engines:
        def on_death(name: str) -> None:
            if name in engine_urls:
                executor.restart(name)
                services.mark_stale(name)
        executor.supervise(on_death)
    return services
