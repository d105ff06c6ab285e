"""Start the inference side of a run: engines, the router in front of them, what the generator needs.

Packages declare services (``miles_register_services``, each a :class:`~miles_contracts.ServiceSpec`);
this module picks those the run needs -- the engine ``rollout.engine`` names, one ``router``, and
the roles the generator's spec lists in ``services`` -- starts them through the executor in
dependency order (engines on the slots placement gave them) and wires the URLs. Every service
process reads the run's settings from the run folder's ``config.yaml`` (``ServiceLaunch.config_path``),
as trainer ranks get the resolved config: one hand-off, so ``plugins.disable`` and every section
reach each process. An engine that dies is restarted by the supervisor
(when ``executor.restart_engines``) and marked stale until the next weight sync gives it the
current weights; the router keeps it out of rotation meanwhile. If it came back at another address
(its node left), the services behind it follow: the router swaps the worker when its spec has
``upstream_moved``, anything else is restarted.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from miles_contracts import Executor, ServiceSpec
from miles_contracts.cluster import ENGINE, ROUTER, SESSION, Endpoint, ServiceLaunch

from miles.config import MilesConfig
from miles.errors import MilesError
from miles.kernel import Kernel
from miles.loop.run_dir import CONFIG_FILE
from miles.placement import Placement, Slot


@dataclass(frozen=True, slots=True)
class Planned:
    """One process of a service: its name, the service, its slot and instance index."""

    name: str
    role: str
    service: ServiceSpec
    slot: Slot
    index: int = 0


@dataclass
class Services:
    """The running inference services and their URLs."""

    executor: Executor
    run_dir: Path
    config: MilesConfig
    model_path: Path
    planned: dict[str, Planned]  # process name -> what it runs
    urls: dict[str, str] = field(default_factory=dict)  # process name -> base URL
    stale_engines: set[str] = field(default_factory=set)  # restarted, waiting for weights
    unconfirmed: set[str] = field(default_factory=set)  # restarted, not yet seen healthy
    _starts: dict[str, int] = field(default_factory=dict)  # process name -> restarts so far
    restarts: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # ------------------------------------------------------------------ URLs

    @property
    def engine_urls(self) -> dict[str, str]:
        """Engine process name -> base URL, in engine order."""
        return {name: self.urls[name] for name, p in self.planned.items() if p.role == ENGINE and name in self.urls}

    def role_urls(self, role: str) -> list[str]:
        return [self.urls[name] for name, p in self.planned.items() if p.role == role and name in self.urls]

    @property
    def router_url(self) -> str:
        return self.role_urls(ROUTER)[0]

    def urls_by_role(self) -> dict[str, list[str]]:
        """Base URLs of every service but the engines, by role (``GenerateContext.service_urls``)."""
        roles = dict.fromkeys(p.role for p in self.planned.values() if p.role != ENGINE)
        return {role: self.role_urls(role) for role in roles}

    @property
    def session_url(self) -> str | None:
        urls = self.role_urls(SESSION)
        return urls[0] if urls else None

    # ------------------------------------------------------------------ health

    def take_stale(self) -> list[str]:
        with self._lock:
            names = sorted(self.stale_engines)
            self.stale_engines.clear()
            return names

    def wait_ready(self, timeout: float = 600.0, *, router: bool = False, probe: bool = False) -> float:
        """Block until every engine process is alive and healthy (the supervisor may be restarting
        one), and with ``router`` until the router serves too (it re-admits a restarted engine at
        its next probe; a rollout started before would see every request refused); returns the
        seconds waited. Raises :class:`MilesError` after ``timeout``.

        An engine seen healthy since its last start and still alive is not asked again unless
        ``probe``: the supervisor restarts a process that dies, and a health request is not free
        on every engine (SGLang's default ``/health`` runs a one-token generation: ~1 s, which this
        wait, called before every rollout and weight sync, used to add to each step)."""
        start = time.monotonic()
        pending = set(self.engine_urls)
        if router:
            pending |= {name for name, p in self.planned.items() if p.role == ROUTER}
        while pending:
            for name in list(pending):
                url = self.urls.get(name)
                if url is None or not self.executor.alive(name):
                    continue
                with self._lock:
                    restarted = name in self.unconfirmed
                    starts = self._starts.get(name, 0)
                if not probe and not restarted and self.planned[name].role == ENGINE:
                    pending.discard(name)  # seen healthy since its last start, and alive
                elif _healthy(url):
                    pending.discard(name)
                    with self._lock:  # unless it died and restarted while it was being asked
                        if self._starts.get(name, 0) == starts:
                            self.unconfirmed.discard(name)
            if pending:
                if time.monotonic() - start > timeout:
                    raise MilesError(f"engine(s) {', '.join(sorted(pending))} not healthy after {timeout:.0f} s; "
                                     f"see {self.run_dir}/logs")
                time.sleep(0.5)
        return time.monotonic() - start

    def starts(self, name: str) -> int:
        """How many times the supervisor has started process ``name`` again (0: never): a changed
        count means a fresh process, which holds none of what the one before was told."""
        with self._lock:
            return self._starts.get(name, 0)

    def mark_stale(self, name: str) -> None:
        with self._lock:
            self.stale_engines.add(name)
            self.restarts += 1

    # ------------------------------------------------------------------ faults

    def handle_death(self, name: str) -> bool:
        """Restart service process ``name`` (if it is one of ours); False for other processes."""
        planned = self.planned.get(name)
        if planned is None:
            return False
        old = self.urls.get(name)
        # no health wait here: every dead process of one sweep is started at once, and the loop
        # waits for healthy engines (wait_ready) before it generates or syncs again
        with self._lock:
            self.unconfirmed.add(name)
            self._starts[name] = self._starts.get(name, 0) + 1
        endpoint = self.executor.restart(name, wait=False)
        self.urls[name] = endpoint.url
        if planned.role == ENGINE:
            self.mark_stale(name)
        if old is not None and old != endpoint.url:
            self._follow(planned.role, old, endpoint.url)
        self.write_manifest()
        return True

    def _follow(self, role: str, old: str, new: str) -> None:
        """Services that need ``role`` learn that one of its instances moved from ``old`` to ``new``."""
        for name, dependent in self.planned.items():
            if role not in dependent.service.needs or name not in self.urls:
                continue
            follow = dependent.service.upstream_moved
            if follow is not None:
                follow(self.urls[name], role, old, new)
            else:
                self.handle_death(name)  # started again with the new upstream URLs

    # ------------------------------------------------------------------ operators

    def write_manifest(self) -> None:
        """``<run>/services.json``: name, role, node, pid, URL, GPUs, restarts and log of every process."""
        rows = []
        for row in self.executor.manifest():
            planned = self.planned.get(row["name"])
            if planned is not None:
                row = {**row, "role": planned.role, "url": self.urls.get(row["name"]),
                       "config_sections": list(planned.service.config_sections)}
            rows.append(row)
        tmp = self.run_dir / "services.json.tmp"
        tmp.write_text(json.dumps(rows, indent=2))
        tmp.rename(self.run_dir / "services.json")


# ---------------------------------------------------------------------- what to start


def _provider(kernel: Kernel, role: str, wanted_by: str) -> ServiceSpec:
    """The one registered service of ``role``."""
    entries = [e for e in kernel.services().entries() if e.obj.role == role]
    if not entries:
        raise MilesError(f"{wanted_by} needs a {role!r} service and none is installed; "
                         f"{kernel.install_state.role_hint(role)}")
    if len(entries) > 1:
        names = ", ".join(f"{e.name} ({e.origin})" for e in entries)
        raise MilesError(f"several plugins register a {role!r} service: {names}; disable all but one with plugins.disable")
    return entries[0].obj


def plan_services(config: MilesConfig, kernel: Kernel, placement: Placement) -> list[Planned]:
    """Every service process of the run, engines first, each after the roles it needs."""
    engine = kernel.services().get(config.rollout.engine)
    planned = [Planned(f"engine-{i}", ENGINE, engine, slot, i) for i, slot in enumerate(placement.engines)]
    generator = kernel.generators().get(config.rollout.generator)
    agent = kernel.agents().get(config.rollout.agent) if generator.needs_agent and config.rollout.agent else None
    wanted = [*generator.services, *(agent.services if agent is not None else ())]
    roles = [ROUTER, *dict.fromkeys(r for r in wanted if r != ROUTER)]
    driver = Slot(placement.trainer[0].node)  # routers and session servers run beside the driver
    providers = {role: _provider(kernel, role, f"the run (generator {config.rollout.generator!r})") for role in roles}
    started = {ENGINE}
    while providers:
        ready = [role for role, s in providers.items() if set(s.needs) <= started]
        if not ready:
            raise MilesError(f"services {', '.join(providers)} need roles nobody provides: "
                             + "; ".join(f"{r} needs {', '.join(s.needs)}" for r, s in providers.items()))
        for role in ready:
            planned.append(Planned(role, role, providers.pop(role), driver))
            started.add(role)
    return planned


def start_services(config: MilesConfig, kernel: Kernel, model_path: Path, executor: Executor, placement: Placement,
                   run_dir: Path) -> Services:
    """Start every service the run needs (engines in parallel, then what needs them); on failure,
    what was started is left to the caller's ``executor.shutdown()``."""
    planned = plan_services(config, kernel, placement)
    services = Services(executor, run_dir, config, model_path, {p.name: p for p in planned})
    for wave in _waves(planned):
        for p in wave:
            executor.launch(p.name, _command(services, p), node=p.slot.node.name, gpus=p.slot.gpus,
                            health_path=p.service.health_path)
        for p in wave:
            executor.wait_healthy(p.name)
            services.urls[p.name] = executor.endpoint(p.name).url
    services.write_manifest()
    return services


def _waves(planned: Sequence[Planned]) -> list[list[Planned]]:
    """Processes grouped by dependency depth (engines first): a group is started together, and
    needs only roles of earlier groups. ``planned`` is in dependency order."""
    depth: dict[str, int] = {}
    for p in planned:
        depth[p.role] = max((depth[r] + 1 for r in p.service.needs if r in depth), default=0)
    waves: dict[int, list[Planned]] = {}
    for p in planned:
        waves.setdefault(depth[p.role], []).append(p)
    return [waves[d] for d in sorted(waves)]


def _command(services: Services, planned: Planned) -> Callable[[Endpoint], list[str]]:
    """argv builder the executor calls with the endpoint it picked (again on every restart, with
    the upstream URLs of that moment)."""

    def command(endpoint: Endpoint) -> list[str]:
        upstream = {role: services.role_urls(role) for role in planned.service.needs}
        run_dir = services.run_dir.resolve()
        launch = ServiceLaunch(services.config, str(run_dir / CONFIG_FILE), str(services.model_path), endpoint,
                               upstream, planned.index, len(planned.slot.gpus), run_dir=str(run_dir))
        try:
            return list(planned.service.command(launch))
        except ValueError as exc:
            raise MilesError(f"cannot start {planned.name} ({planned.role} service): {exc}") from exc

    return command


def _healthy(url: str, timeout: float = 5.0) -> bool:
    """``GET {url}/health`` answers 200, or 503 ``{"status": "paused"}``: an engine paused on
    purpose (a weight sync that failed half-way leaves engines paused until the next one) is up and
    can take weights. Plain ``http.client``: called before every weight sync, and ``httpx.get``
    builds a client (and its TLS context) per call, ~30 ms. (The router answers 503 while no engine
    serves, without ``paused``: not healthy.)"""
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
