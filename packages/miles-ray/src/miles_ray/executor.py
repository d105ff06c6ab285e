"""`RayExecutor`: a run's processes on the GPUs of a Ray cluster.

* **Cluster.** ``ray.address`` (or ``RAY_ADDRESS``) joins an existing cluster; otherwise a Ray
  instance starts on this machine. The driver stays where it was started (the head node).
* **Reservation.** The GPUs placement needs are one placement group of ``{gpu_resource: 1}``
  bundles. A :class:`~miles_ray.host.ProcessHost` actor in each bundle reports its node and GPU id;
  bundles are ordered by (node address, head node first, node id, GPU id), so rank order is stable
  and trainer rank 0 sits on the first GPU of the first node.
* **Processes** (trainer ranks, engines, the router) are started by the host of their first
  bundle, with ``CUDA_VISIBLE_DEVICES`` set to the GPUs of their bundles, on a port free on that
  node; processes without GPUs run beside the driver. They listen on 127.0.0.1 when the whole run
  is on the driver's node, else on their node's address (:mod:`miles_ray.addresses`). Every process gets the run token
  (``MILES_AUTH_TOKEN``), the ``MILES_*`` variables and ``ray.forward_env`` explicitly: Ray workers
  inherit the environment of ``ray start``, not the driver's.
* **Logs** are written on each node and copied into ``<run>/logs/<name>.log`` every
  ``ray.log_interval`` seconds, so a run folder looks the same on every executor.
* **Faults.** A node that leaves takes its hosts and processes with it; Ray places its bundles
  elsewhere when resources allow and restarts the hosts there, and :meth:`restart` (called by the
  run's supervisor) waits for that and starts the process again, on a new address. ``shutdown``
  stops every process, kills every host and removes the placement group.

Ray's own calls between the driver and its actors use Ray's serialisation: the Ray cluster is a
trust boundary (never expose its ports). Miles' own channels (trainer ranks, HTTP) are unchanged.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from miles.errors import MilesError
from miles.executor.local import PORT_ATTEMPTS
from miles.private_files import open_private, private_dir
from miles_contracts.cluster import EXIT_ADDRESS_IN_USE, Endpoint, Node

from miles_ray.addresses import process_address
from miles_ray.config import RaySection
from miles_ray.host import ProcessHost

_CALL_TIMEOUT = 30.0
_HEAD = "node:__internal_head__"


class RayExecutorError(MilesError):
    """The Ray cluster could not give the run what it needs, or a process there failed to start."""


@dataclass
class _Process:
    name: str
    command: Callable[[Endpoint], Sequence[str]]
    hosts: list[Any]  # actor handles: the bundles of its GPUs, or one pinned host
    health_path: str | None
    env: dict[str, str]
    gpus: tuple[str, ...]
    endpoint: Endpoint | None = None
    node: str = ""
    pid: int | None = None
    host_pid: int | None = None
    restarts: int = 0
    log_offset: int = 0
    ended: int | None = None  # exit status once seen dead
    # being (re)started: its host has not spawned it yet, so a poll says "unknown", which is no death
    starting: bool = True
    # the log's copying and its offset (not the executor's lock: a copy from a lost node waits
    # out its timeout, and launches and restarts of other processes must not wait with it)
    log_lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    @property
    def log_name(self) -> str:
        return f"{self.name}.{self.restarts}.log"


@dataclass
class _Bundle:
    host: Any
    node: str
    address: str
    gpu: str


@dataclass
class _Cluster:
    """What this run holds: its placement group, its bundles' hosts, pinned hosts per node."""

    group: Any = None
    bundles: dict[tuple[str, str], _Bundle] = field(default_factory=dict)
    pinned: dict[str, Any] = field(default_factory=dict)


class RayExecutor:
    """Implements :class:`miles_contracts.Executor` on a Ray cluster (see the module docstring)."""

    def __init__(self, section: RaySection, run_dir: Path, *, startup_timeout: float = 600.0) -> None:
        import ray

        self.section = section
        self.startup_timeout = startup_timeout
        self.log_dir = private_dir(run_dir / "logs")
        self.run_id = f"{run_dir.name}-{uuid.uuid4().hex[:6]}"
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            address = section.address or os.environ.get("RAY_ADDRESS")
            options: dict[str, Any] = {"log_to_driver": False, "include_dashboard": False}
            if address:
                options["address"] = address
            else:
                options.update(num_cpus=section.num_cpus, object_store_memory=section.object_store_mb << 20)
            if section.node_ip_address:
                options["_node_ip_address"] = section.node_ip_address
            ray.init(**options)
        self._remote_host = ray.remote(ProcessHost)
        self._driver_node = ray.get_runtime_context().get_node_id()
        self._nodes_in_use: set[str] = set()  # nodes the run's processes are placed on
        self._cluster = _Cluster()
        self._processes: dict[str, _Process] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._copy_logs_forever, name="miles-ray-logs", daemon=True)]
        self._threads[0].start()

    # -------------------------------------------------------------- capacity and reservation

    def nodes(self) -> list[Node]:
        import ray

        alive = sorted((n for n in ray.nodes() if n.get("Alive")), key=_node_order)
        return [Node(n["NodeID"], n["NodeManagerAddress"],
                     tuple(str(i) for i in range(int(n["Resources"].get(self.section.gpu_resource, 0)))))
                for n in alive]

    def reserve(self, gpus: int) -> list[Node]:
        if gpus == 0:
            head = self.nodes()[0]
            self._nodes_in_use = {head.name}
            return [Node(head.name, self._address(head.address))]
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        resource = self.section.gpu_resource
        group = placement_group([{resource: 1.0} for _ in range(gpus)], strategy=self.section.strategy,
                                name=f"miles-{self.run_id}")
        try:
            ray.get(group.ready(), timeout=self.startup_timeout)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            have = sum(len(n.gpus) for n in self.nodes())
            raise RayExecutorError(
                f"the Ray cluster could not reserve {gpus} x {{{resource}: 1}} ({self.section.strategy}) within "
                f"{self.startup_timeout:.0f} s; its alive nodes offer {have} {resource} in all"
            ) from None
        self._cluster.group = group
        hosts = [self._host(scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
                            max_restarts=-1, **self._gpu_request()) for i in range(gpus)]
        infos = ray.get([h.info.remote() for h in hosts], timeout=self.startup_timeout)
        by_node: dict[str, list[_Bundle]] = {}
        for host, info in zip(hosts, infos, strict=True):
            bundles = by_node.setdefault(info["node_id"], [])
            # a custom resource has no device ids: number the node's bundles instead
            gpu = info["gpus"][0] if info["gpus"] else str(len(bundles))
            bundles.append(_Bundle(host, info["node_id"], info["address"], gpu))
        for node, bundles in by_node.items():
            for bundle in bundles:
                self._cluster.bundles[(node, bundle.gpu)] = bundle
        self._nodes_in_use = set(by_node)
        order = {n.name: i for i, n in enumerate(self.nodes())}
        return [Node(node, self._address(bundles[0].address), tuple(b.gpu for b in bundles))
                for node, bundles in sorted(by_node.items(), key=lambda item: order.get(item[0], len(order)))]

    def driver_address(self) -> str:
        import ray

        return self.section.node_ip_address or self._address(ray.util.get_node_ip_address())

    # -------------------------------------------------------------- processes

    def launch(self, name: str, command: Callable[[Endpoint], Sequence[str]], *, node: str, gpus: Sequence[str] = (),
               health_path: str | None = None, env: Mapping[str, str] | None = None) -> Endpoint:
        hosts = [self._cluster.bundles[(node, gpu)].host for gpu in gpus] if gpus else [self._pinned(node)]
        process = _Process(name, command, hosts, health_path, {**self._forwarded_env(), **(env or {})}, tuple(gpus))
        previous = self._processes.get(name)
        if previous is not None and (previous.starting or self._status(previous) is None):
            raise RayExecutorError(f"a process named {name!r} is already running; process names are unique in "
                                   f"a run (restart it with restart({name!r}))")
        with self._lock:
            self._processes[name] = process
        self._spawn(process)
        assert process.endpoint is not None
        return process.endpoint

    def wait_healthy(self, name: str) -> None:
        process = self._processes[name]
        if process.health_path is None or process.endpoint is None:
            return
        url = f"{process.endpoint.url}{process.health_path}"
        deadline = time.monotonic() + self.startup_timeout
        moves = 0
        # no proxy from HTTP_PROXY between the run's own processes (it would see nothing it may reach)
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if not self.alive(name):
                    self._copy_logs(process)
                    if process.ended == EXIT_ADDRESS_IN_USE and moves < PORT_ATTEMPTS:
                        moves += 1  # its port was taken before it listened: again, on a port picked anew
                        process.starting, process.ended = True, None
                        self._spawn(process)
                        url = f"{process.endpoint.url}{process.health_path}"
                        continue
                    raise RayExecutorError(f"{name!r} exited with status {process.ended} during start-up on "
                                           f"{process.node}; log {self.log_dir / (name + '.log')}:\n{self._tail(name)}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(url).status_code == 200:
                        return
                time.sleep(0.25)
        raise RayExecutorError(f"{name!r} was not healthy at {url} after {self.startup_timeout:.0f} s; "
                               f"log {self.log_dir / (name + '.log')}:\n{self._tail(name)}")

    def endpoint(self, name: str) -> Endpoint:
        endpoint = self._processes[name].endpoint
        assert endpoint is not None
        return endpoint

    def alive(self, name: str) -> bool:
        return self._status(self._processes[name]) is None

    def returncode(self, name: str) -> int | None:
        process = self._processes[name]
        self._status(process)
        return process.ended

    def restart(self, name: str, *, wait: bool = True) -> Endpoint:
        """Start ``name`` again -- on its bundles' new node if its node left (waiting until Ray
        placed them again, up to the start-up timeout) -- and wait until it is healthy."""
        process = self._processes[name]
        with contextlib.suppress(Exception):
            self._call(process.hosts[0].terminate.remote(name), timeout=10)
        with process.log_lock:
            with contextlib.suppress(Exception):
                self._copy_logs(process)
            process.starting = True  # before the restart count moves: the watcher must not see a death yet
            process.restarts += 1
            process.log_offset = 0
            process.ended = None
        self._spawn(process)
        if wait:
            self.wait_healthy(name)
        return self.endpoint(name)

    def supervise(self, on_death: Callable[[str], None]) -> None:
        def watch() -> None:
            reported: dict[str, int] = {}
            while not self._stop.wait(self.section.supervise_interval):
                for process in list(self._processes.values()):
                    if self._stop.is_set() or process.starting or reported.get(process.name) == process.restarts:
                        continue
                    if self._status(process) is not None:
                        reported[process.name] = process.restarts
                        try:
                            on_death(process.name)
                        except Exception as exc:  # keep watching the others
                            print(f"miles: handling the death of {process.name!r} failed: {exc}", flush=True)

        thread = threading.Thread(target=watch, name="miles-ray-supervisor", daemon=True)
        self._threads.append(thread)
        thread.start()

    def manifest(self) -> list[dict[str, Any]]:
        import ray

        names = {n["NodeID"]: n.get("NodeName") for n in ray.nodes()}
        return [{"name": p.name, "node": p.node, "node_name": names.get(p.node), "pid": p.pid, "host_pid": p.host_pid,
                 "gpus": list(p.gpus), "restarts": p.restarts, "log": str(self.log_dir / f"{p.name}.log")}
                for p in self._processes.values()]

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        self._stop.set()
        hosts = [b.host for b in self._cluster.bundles.values()] + list(self._cluster.pinned.values())
        stops = [h.stop_all.remote() for h in hosts]
        with contextlib.suppress(Exception):
            ray.wait(stops, num_returns=len(stops), timeout=_CALL_TIMEOUT)
        for process in self._processes.values():
            with contextlib.suppress(Exception):
                self._copy_logs(process)
        for host in hosts:
            with contextlib.suppress(Exception):
                ray.kill(host)
        if self._cluster.group is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self._cluster.group)
        self._cluster = _Cluster()
        if self._started_ray:
            ray.shutdown()

    # -------------------------------------------------------------- internals

    def _host(self, **options: Any) -> Any:
        return self._remote_host.options(num_cpus=0, max_task_retries=0, **options).remote(self.run_id)

    def _gpu_request(self) -> dict[str, Any]:
        resource = self.section.gpu_resource
        return {"num_gpus": 1} if resource == "GPU" else {"resources": {resource: 1}}

    def _pinned(self, node: str) -> Any:
        """A host on ``node`` outside the placement group (processes without GPUs)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        with self._lock:
            if node not in self._cluster.pinned:
                strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
                self._cluster.pinned[node] = self._host(scheduling_strategy=strategy)
            return self._cluster.pinned[node]

    def _forwarded_env(self) -> dict[str, str]:
        names = [k for k in os.environ if k.startswith("MILES_")] + list(self.section.forward_env)
        return {k: os.environ[k] for k in names if k in os.environ}

    def _spawn(self, process: _Process) -> None:
        try:
            self._spawn_on_host(process)
        finally:
            process.starting = False  # spawned, or failed to: from now on a poll tells the truth

    def _spawn_on_host(self, process: _Process) -> None:
        import ray

        deadline = time.monotonic() + self.startup_timeout
        while True:  # a host whose node left comes back once Ray placed its bundle again
            try:
                infos = self._call([h.info.remote() for h in process.hosts], timeout=10)
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                if time.monotonic() > deadline:
                    raise RayExecutorError(f"no node could take {process.name!r} again within "
                                           f"{self.startup_timeout:.0f} s (its bundles are not placed)") from None
                time.sleep(1.0)
        host = process.hosts[0]
        process.node, process.host_pid = infos[0]["node_id"], infos[0]["pid"]
        # a host that Ray placed again after its node left may be on another node than the driver's
        address = self._address(infos[0]["address"], on=infos[0]["node_id"])
        process.endpoint = Endpoint(address, self._call(host.free_port.remote()))
        env = dict(process.env)
        if process.gpus and self.section.gpu_resource == "GPU":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(g for info in infos for g in info["gpus"])
        argv = list(process.command(process.endpoint))
        process.pid = self._call(host.spawn.remote(process.name, process.log_name, argv, env))

    def _address(self, node_address: str, *, on: str | None = None) -> str:
        """Where a process on the node ``on`` (default: one the run reserved) at ``node_address`` listens."""
        nodes = self._nodes_in_use | {on} if on is not None else self._nodes_in_use
        return process_address(node_address, nodes, self._driver_node)

    def _status(self, process: _Process) -> int | str | None:
        """None while ``process`` runs; otherwise why not (exit status, or ``lost`` with its host)."""
        import ray

        try:
            status = self._call(process.hosts[0].poll.remote(process.name), timeout=10)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return "lost"
        if isinstance(status, int):
            process.ended = status
        return status

    def _call(self, refs: Any, timeout: float = _CALL_TIMEOUT) -> Any:
        import ray

        return ray.get(refs, timeout=timeout)

    def _copy_logs_forever(self) -> None:
        while not self._stop.wait(self.section.log_interval):
            for process in list(self._processes.values()):
                with contextlib.suppress(Exception):
                    self._copy_logs(process)

    def _copy_logs(self, process: _Process) -> None:
        with process.log_lock:
            while True:
                chunk = self._call(process.hosts[0].read_log.remote(process.log_name, process.log_offset), timeout=10)
                if not chunk:
                    return
                with open_private(self.log_dir / f"{process.name}.log") as log:
                    log.write(chunk)  # redacted on its node, as it was written there
                process.log_offset += len(chunk)

    def _tail(self, name: str, lines: int = 25) -> str:
        try:
            return "\n".join((self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _node_order(node: Mapping[str, Any]) -> tuple[str, int, str]:
    """Nodes by address; among nodes of one address (several on one machine) the head first."""
    return (str(node["NodeManagerAddress"]), 0 if _HEAD in node.get("Resources", {}) else 1, str(node["NodeID"]))
