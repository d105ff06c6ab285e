"""A real Ray cluster of several nodes on this machine (used through the ``ray_cluster`` fixture).

Each node is a ``ray start --block`` in its own process group (so one node can be killed the way a
machine disappears), with this session's own temp dir and GCS port, and a custom resource
``miles_gpu`` standing in for GPUs (this machine has none). Nothing here touches another Ray
instance on the machine: nodes are stopped by killing their own process groups, never by
``ray stop``.

A node counts as started once its ``ray start`` says so ("Ray runtime started.", printed once Ray
found the node in the GCS's node table); the fixture then checks who is in the cluster through
Ray's own node list (:meth:`LocalRayCluster.wait_members`, a driver asking ``ray.nodes()``).

Starting a node on a loaded machine: Ray (2.60) gives a starting node two fixed windows that no
flag, environment variable or system config changes. The raylet aborts when its dashboard agent (a
Python process, which has to import Ray first) has not written its port file within 15 s ("Timed
out waiting for file .../dashboard_agent_listen_port_..." in the raylet's log), and ``ray start``
gives up when the raylet has not registered within 30 s (``raylet_start_wait_time_s = 30``, a
constant in ``ray._private.node.Node``; ``RAY_raylet_start_wait_time_s`` is a different, C++
setting). With the load many times the cores, the agent's imports alone can take longer, so
:meth:`LocalRayCluster.add` starts a node again when -- and only when -- it failed that way, until its
deadline; any other failure is reported at once, with the log.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from miles_contracts.testing.processes import DEADLINE_S, LoggedProcess, NotReady, log_says, wait_ready

GPU = "miles_gpu"
RAY = [sys.executable, "-m", "ray.scripts.scripts"]
# quiet, local, and quick to notice a dead node (health checks every second, dead after 3 misses)
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
           "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
           "RAY_health_check_initial_delay_ms": "1000"}
STARTED = "Ray runtime started."  # printed by `ray start` once the node is in the GCS's node table
MISSED_WINDOW = b"timed out during startup"  # `ray start`'s words when a start-up window was missed
# A driver that waits until every node named is alive in Ray's node list, then prints their resources.
MEMBERS = r"""
import json, sys, time, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
seen = None
while True:
    alive = {n["NodeName"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    if set(sys.argv[2:]) <= set(alive):
        print("members:", json.dumps(alive), flush=True)
        break
    if sorted(alive) != seen:
        seen = sorted(alive)
        print("alive so far:", seen, flush=True)
    time.sleep(0.5)
"""


class LocalRayCluster:
    """Ray nodes started as child process groups of the test session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.nodes: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, **RAY_ENV}

    def start(self, name: str, gpus: int, *, head: bool = False) -> None:
        """Start node ``name`` with ``gpus`` stand-in GPUs (the head first); :meth:`add` also waits for it."""
        common = ["--num-cpus=4", f"--resources={json.dumps({GPU: gpus})}", "--object-store-memory=100000000",
                  f"--node-name={name}", "--disable-usage-stats", "--block"]
        where = ["--head", f"--port={self.port}", f"--temp-dir={self.root / 'ray'}", "--include-dashboard=false"] \
            if head else [f"--address={self.address}"]
        log = self.root / f"{name}.log"
        with log.open("wb") as out:
            self.nodes[name] = subprocess.Popen([*RAY, "start", *where, *common], stdout=out, stderr=subprocess.STDOUT,
                                                env=self.env, start_new_session=True)

    def add(self, name: str, gpus: int, *, head: bool = False, deadline_s: float = DEADLINE_S) -> None:
        """Start node ``name`` and wait until its ``ray start`` says the node runs. A start that missed
        one of Ray's fixed start-up windows (see the module docstring) is tried again, until
        ``deadline_s``; the failed attempts' logs stay next to the node's as ``<name>.<n>.log``."""
        deadline = time.monotonic() + deadline_s
        for attempt in itertools.count(1):
            self.start(name, gpus, head=head)
            log = self.root / f"{name}.log"
            try:
                wait_ready(log_says(log, STARTED), f"ray node {name!r} (start {attempt})", process=self.nodes[name],
                           log=log, deadline_s=max(deadline - time.monotonic(), 1.0))
                return
            except NotReady:
                self.kill(name)
                if MISSED_WINDOW not in log.read_bytes() or time.monotonic() > deadline:
                    raise
                log.rename(self.root / f"{name}.{attempt}.log")

    def wait_members(self, gpus: Mapping[str, int], *, deadline_s: float = DEADLINE_S) -> dict[str, dict[str, float]]:
        """Until Ray's node list (``ray.nodes()``, asked by a driver connected to the cluster) has every
        node of ``gpus`` alive; checks that each offers that many stand-in GPUs. Returns the
        resources of the nodes alive."""
        log = self.root / "members.log"
        with LoggedProcess([sys.executable, "-c", MEMBERS, self.address, *gpus], log, env=RAY_ENV) as probe:
            probe.wait_ready(log_says(log, "members: "), f"ray nodes {sorted(gpus)} alive in Ray's node list",
                             deadline_s=deadline_s)
            probe.wait_exit("the node-list driver to disconnect")
        members: dict[str, dict[str, float]] = json.loads(log.read_text().split("members: ", 1)[1])
        offered = {name: members[name].get(GPU, 0) for name in gpus}
        assert offered == dict(gpus), f"stand-in GPUs per node: {offered}, expected {dict(gpus)}"
        return members

    def kill(self, name: str, *, also: Sequence[int] = ()) -> None:
        """Take a node away at once, as a machine that dies: SIGKILL to its process group and to
        ``also`` (processes of the node in sessions of their own, e.g. what actors started)."""
        process = self.nodes.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        for pid in also:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait()

    def close(self) -> None:
        for name in list(self.nodes):
            self.kill(name)

    def leftovers(self) -> list[str]:
        """Processes still running from this cluster's nodes (by their session folder)."""
        marker = str(self.root)
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline:
                found.append(f"{proc.name}: {cmdline[:120]}")
        return found
