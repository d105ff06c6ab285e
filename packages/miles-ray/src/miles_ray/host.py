"""`ProcessHost`: the Ray actor that runs a run's processes on its node.

One host lives in each GPU bundle of the run's placement group (and one, pinned, on a node that
runs processes without GPUs: the router beside the driver). It starts processes exactly as the local
executor does (:func:`miles.executor.children.spawn`: own process group, parent-death signal),
output to a log file on its node (0600 in a 0700 folder, the run's secrets redacted:
``miles.executor.output``), and answers the driver's questions about them (alive? exit code? log
bytes since offset N?). The driver copies the logs into ``<run>/logs`` (nodes need not share a filesystem).

A host in a bundle is restarted by Ray (``max_restarts=-1``) when its node leaves and the bundle
is placed elsewhere; it then knows no process, and the executor starts them again on it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from miles.executor.children import free_port, spawn, terminate_all, terminate_group
from miles.executor.output import OutputPump, open_log
from miles.private_files import private_dir
from miles.redaction import Redactor

_READ_LIMIT = 1 << 20


class ProcessHost:
    """Starts, watches and stops processes on this actor's node (used as a Ray actor)."""

    def __init__(self, run_id: str) -> None:
        self.log_dir = private_dir(Path(tempfile.gettempdir()) / "miles-ray-logs" / run_id)
        self._processes: dict[str, subprocess.Popen[bytes]] = {}
        self._outputs: dict[str, OutputPump] = {}
        self._logs: dict[str, Path] = {}

    def info(self) -> dict[str, Any]:
        """Where this host runs: node id and address, GPU ids Ray gave it, its pid."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "address": ray.util.get_node_ip_address(),
                "gpus": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def free_port(self) -> int:
        return free_port("")  # this node's: any interface, as the services it starts bind their address

    def spawn(self, name: str, log_name: str, argv: Sequence[str], env: Mapping[str, str]) -> int:
        """Start ``argv`` as process ``name``, its output in log ``log_name``; returns its pid."""
        self.terminate(name)
        path = self.log_dir / log_name
        redactor = Redactor.for_environment(os.environ, env)
        log = open_log(path, redactor, argv, where=f" on {socket.gethostname()}")
        try:
            process = spawn(argv, log=subprocess.PIPE, env={**os.environ, **env})  # dies with this actor's process
        except BaseException:
            log.close()
            raise
        assert process.stdout is not None
        self._processes[name] = process
        self._outputs[name] = OutputPump(process.stdout, log, redactor, name=name)
        self._logs[log_name] = path
        return process.pid

    def poll(self, name: str) -> int | str | None:
        """None while ``name`` runs, its exit status once it ended, ``"unknown"`` if this host never
        started it (a host restarted on another node)."""
        process = self._processes.get(name)
        if process is None:
            return "unknown"
        status = process.poll()
        if status is not None:
            self._outputs[name].settle()  # its last lines are in the log before it is read
        return status

    def read_log(self, log_name: str, offset: int) -> bytes:
        path = self._logs.get(log_name)
        if path is None or not path.exists():
            return b""
        with path.open("rb") as log:
            log.seek(offset)
            return log.read(_READ_LIMIT)

    def terminate(self, name: str, grace: float = 5.0) -> None:
        process = self._processes.pop(name, None)
        if process is not None:
            terminate_group(process, grace)
            self._outputs.pop(name).settle()

    def stop_all(self) -> None:
        processes = list(self._processes.values())
        self._processes.clear()
        terminate_all(processes)
        for name in list(self._outputs):
            self._outputs.pop(name).settle()
