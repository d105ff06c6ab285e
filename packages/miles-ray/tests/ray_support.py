"""A real Ray cluster of several nodes on this machine (used through the ``ray_cluster`` fixture).

Each node is a ``ray start --block`` in its own process group (so one node can be killed the way a
machine disappears), with this session's own temp dir and GCS port, and a custom resource
``miles_gpu`` standing in for GPUs (this machine has none). Nothing here touches another Ray
instance on the machine: nodes are stopped by killing their own process groups, never by
``ray stop``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

GPU = "miles_gpu"
RAY = [sys.executable, "-m", "ray.scripts.scripts"]
# quiet, local, and quick to notice a dead node (health checks every second, dead after 3 misses)
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
           "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
           "RAY_health_check_initial_delay_ms": "1000"}


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
        """Start node ``name`` with ``gpus`` stand-in GPUs (the head first); :meth:`wait` for it."""
        common = ["--num-cpus=4", f"--resources={json.dumps({GPU: gpus})}", "--object-store-memory=100000000",
                  f"--node-name={name}", "--disable-usage-stats", "--block"]
        where = ["--head", f"--port={self.port}", f"--temp-dir={self.root / 'ray'}", "--include-dashboard=false"] \
            if head else [f"--address={self.address}"]
        log = self.root / f"{name}.log"
        with log.open("wb") as out:
            self.nodes[name] = subprocess.Popen([*RAY, "start", *where, *common], stdout=out, stderr=subprocess.STDOUT,
                                                env=self.env, start_new_session=True)

    def add(self, name: str, gpus: int, *, head: bool = False, attempts: int = 2) -> None:
        """Start node ``name`` and wait until it joined. ``ray start`` gives a raylet 30 s to register
        (not configurable), which a loaded machine can miss: then it is tried once more."""
        for attempt in range(attempts):
            self.start(name, gpus, head=head)
            try:
                self.wait(name)
                return
            except RuntimeError:
                self.kill(name)
                if attempt == attempts - 1:
                    raise

    def wait(self, *names: str, timeout: float = 180) -> None:
        """Until every node of ``names`` joined."""
        deadline = time.monotonic() + timeout
        for name in names:
            log = self.root / f"{name}.log"
            while b"block forever" not in log.read_bytes():
                if self.nodes[name].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"ray node {name} did not start:\n{log.read_text(errors='replace')[-3000:]}")
                time.sleep(0.5)

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
