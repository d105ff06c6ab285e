"""The servers a session benchmark starts, and what it reads from them (health, CPU time, file limits)."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import time
from contextlib import ExitStack


def model_path(name: str) -> str:
    if name == "tiny-dense":
        from miles_models.testing import tiny_model

        return str(tiny_model("dense"))
    return name


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_process(stack: ExitStack, argv: list[str], timeout: float) -> tuple[str, int]:
    """Start ``argv --port P`` and wait for its /health: ``(url, pid)``; stopped when ``stack`` closes."""
    import httpx
    from miles_contracts.wire.auth import ensure_run_token

    ensure_run_token()  # the servers inherit it; the bench's clients send it
    port = _free_port()
    process = subprocess.Popen([*argv, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stack.callback(_stop, process)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            assert process.stderr is not None  # stderr=PIPE
            raise RuntimeError(f"`{' '.join(argv)}` exited with {process.returncode}: {process.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0, trust_env=False).status_code == 200:
                return url, process.pid
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"`{' '.join(argv)}` did not become healthy within {timeout}s")


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` (None where /proc is not available)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def raise_open_file_limit(needed: int) -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (the servers started from here
    inherit it) and return it; refuse, saying why, when even that is below ``needed``.

    Each concurrent session holds a keep-alive connection from the bench to the session server and
    one from there to the engine, and the direct pass one more from the bench to the engine: 1000
    sessions need ~2,000 descriptors in the bench and in each server, twice the common soft limit
    of 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft < needed:
        raise RuntimeError(f"this many concurrent sessions need about {needed} open files per process, but the "
                           f"limit is {soft} (hard limit {hard}); raise it (`ulimit -n {needed}`) or lower --concurrency")
    return soft


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[index]
