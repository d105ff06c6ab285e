"""Start the inference side of a run: engines, the router in front of them, a session server.

The executor owns the processes; this module decides what to start and wires the URLs. An engine
that dies is restarted by the supervisor (when ``executor.restart_engines``) and marked stale until
the next weight sync gives it the current weights; the router keeps it out of rotation meanwhile.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_contracts import EngineSpec
from miles_contracts.wire.auth import ensure_run_token

from miles.config import MilesConfig
from miles.errors import MilesError
from miles.executor.local import free_port
from miles.kernel import Kernel

HOST = "127.0.0.1"


@dataclass
class Services:
    """URLs of the running inference services."""

    executor: Any
    run_dir: Path
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

    def wait_ready(self, timeout: float = 600.0, *, router: bool = False) -> float:
        """Block until every engine process is alive and healthy (the supervisor may be restarting
        one), and with ``router`` until the router serves too (it re-admits a restarted engine at
        its next probe; a rollout started before would see every request refused); returns the
        seconds waited. Raises :class:`MilesError` after ``timeout``."""
        start = time.monotonic()
        pending = dict(self.engine_urls)
        if router:
            pending["router"] = self.router_url
        while pending:
            for name, url in list(pending.items()):
                if self.executor.alive(name) and _healthy(url):  # the router answers 503 while no engine serves
                    del pending[name]
            if pending:
                if time.monotonic() - start > timeout:
                    raise MilesError(f"engine(s) {', '.join(pending)} not healthy after {timeout:.0f} s; see {self.run_dir}/logs")
                time.sleep(0.5)
        return time.monotonic() - start

    def write_manifest(self, run_dir: Path) -> None:
        """``<run>/services.json``: name, pid, URL and restarts of every service (for operators)."""
        urls = {**self.engine_urls, "router": self.router_url, "session": self.session_url}
        rows = [{"name": name, "pid": svc.process.pid if svc.process else None, "url": urls.get(name),
                 "restarts": svc.restarts, "log": str(svc.log_path)}
                for name, svc in self.executor.services().items()]
        tmp = run_dir / "services.json.tmp"
        tmp.write_text(json.dumps(rows, indent=2))
        tmp.rename(run_dir / "services.json")

    def mark_stale(self, name: str) -> None:
        with self._lock:
            self.stale_engines.add(name)
            self.restarts += 1


def _miles_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "miles.cli.main", *args]


def engine_options(config: MilesConfig, engine: Any) -> dict[str, Any]:
    """``EngineSpec.options`` from the engine's own config section: the one its ``config_section``
    names (``engine`` for the embedded engine, ``sglang`` for SGLang), when its plugin registers it."""
    section = config.extra.get(getattr(engine, "config_section", "engine"))
    return section.options() if section is not None and hasattr(section, "options") else {}


def _optional(module: str, name: str, distribution: str) -> Any:
    """A function of a sibling package the loop needs, with an install hint when it is missing."""
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise MilesError(f"miles train needs {distribution}: pip install {distribution} ({exc})") from exc


def start_services(config: MilesConfig, kernel: Kernel, model_path: Path, run_dir: Path) -> Services:
    ensure_run_token()  # in this process's environment, so every service started below inherits it
    executor = kernel.executors().get(config.executor.name)(config, run_dir)
    try:
        engine = kernel.inference_engines().get(config.rollout.engine)
        options = engine_options(config, engine)
        engine_urls = {}
        for i in range(config.rollout.num_engines):
            spec = EngineSpec(model_path=str(model_path), port=free_port(HOST), host=HOST,
                              device=config.model.device, dtype=config.model.dtype, options=dict(options),
                              deterministic=config.run.deterministic,
                              weight_dirs=[str(run_dir.resolve())])
            name = f"engine-{i}"
            executor.start(name, engine.command(spec), health_url=f"{spec.url}/health")
            engine_urls[name] = spec.url

        router_command = _optional("miles_router", "router_command", "miles-router")
        router_port = free_port(HOST)
        router_url = f"http://{HOST}:{router_port}"
        argv = router_command(list(engine_urls.values()), port=router_port, host=HOST, section=config.router)
        executor.start("router", argv, health_url=f"{router_url}/health")

        session_url = None
        if config.rollout.generator == "agentic":
            port = free_port(HOST)
            session_url = f"http://{HOST}:{port}"
            session_arguments = _optional("miles_tito.server.cli", "session_arguments", "miles-tito")
            executor.start("session", _miles_cli("serve", "session", "--host", HOST, "--port", str(port),
                                                 "--router", router_url, "--model", str(model_path),
                                                 *session_arguments(config)),
                           health_url=f"{session_url}/health")
    except BaseException:
        executor.shutdown()
        raise

    services = Services(executor, run_dir, engine_urls, router_url, session_url)
    services.write_manifest(run_dir)
    if config.executor.restart_engines:
        def on_death(name: str) -> None:
            executor.restart(name)
            if name in engine_urls:
                services.mark_stale(name)
            services.write_manifest(run_dir)
        executor.supervise(on_death)
    return services


def _healthy(url: str, timeout: float = 5.0) -> bool:
    """``GET {url}/health`` answers 200, or 503 ``{"status": "paused"}``: an engine paused on
    purpose (a weight sync that failed half-way leaves engines paused until the next one) is up and
    can take weights. Plain ``http.client``: called before every weight sync, and ``httpx.get``
    builds a client (and its TLS context) per call, ~30 ms."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = connection_class(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        connection.request("GET", f"{parts.path.rstrip('/')}/health")
        response = connection.getresponse()
        if response.status == 200:
            return True
        return response.status == 503 and json.loads(response.read() or b"{}").get("status") == "paused"
    except (OSError, http.client.HTTPException, ValueError, AttributeError):
        return False
    finally:
        connection.close()
