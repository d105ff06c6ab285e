"""Process-level guarantees: SIGTERM stops every server within seconds (even an engine blocked
joining a weight group), a killed driver's shared-memory buckets do not outlive the next start and
are private, and an interrupted or failed run never exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from miles_contracts.wire.auth import auth_headers
from security_support import free_port

STOP_WITHIN_S = 10.0


def _start(argv: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    process = subprocess.Popen([*argv, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return process, f"http://127.0.0.1:{port}"


def _wait_healthy(process: subprocess.Popen[bytes], url: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"exited {process.returncode}: {process.stderr.read()[-2000:]!r}")  # type: ignore[union-attr]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not healthy within {timeout} s")


@pytest.mark.slow
def test_sigterm_stops_each_server_within_seconds(tiny_dense: Path) -> None:
    engine, engine_url = _start([sys.executable, "-m", "miles_engine", "--model", str(tiny_dense), "--device", "cpu",
                                 "--context-length", "64", "--weight-group-timeout", "600"])
    router, router_url = _start([sys.executable, "-m", "miles_router", "--worker", engine_url, "--request-timeout", "600"])
    session, session_url = _start([sys.executable, "-m", "miles_tito.server", "--router", router_url,
                                   "--model", str(tiny_dense), "--family", "chatml"])
    processes = [engine, router, session]
    try:
        for process, url in zip(processes, (engine_url, router_url, session_url), strict=True):
            _wait_healthy(process, url)
        # The engine blocks in a weight-group join nobody hosts (600 s allowed), a request waits on it
        # through the router; a session request waits in the session server.
        group = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
                 "backend": "gloo"}
        pending = [threading.Thread(target=_quietly, args=(f"{engine_url}/init_weights_update_group", group), daemon=True)]
        pending[0].start()
        time.sleep(1.0)
        for process in processes:
            process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        for process in processes:
            process.wait(timeout=STOP_WITHIN_S + 5)
        assert time.monotonic() - started < STOP_WITHIN_S
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def _quietly(url: str, body: dict) -> None:
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(url, json=body, headers=auth_headers(), timeout=600)


def test_a_killed_drivers_shared_memory_buckets_are_private_and_removed_at_the_next_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_SHM_DIR", str(tmp_path))
    driver = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from miles_contracts.wire.tensors import create_shm_file; "
        "print(create_shm_file(4096), flush=True); time.sleep(600)")], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "MILES_SHM_DIR": str(tmp_path)})
    orphan = Path(driver.stdout.readline().strip())  # type: ignore[union-attr]
    assert stat.S_IMODE(orphan.stat().st_mode) == 0o600  # weights are not for other local users
    driver.kill()  # SIGKILL: no chance to clean up
    driver.wait()
    from miles_contracts.wire.tensors import create_shm_file
    from miles_weights.packing import ShmArena

    live = create_shm_file(16)  # this process's own bucket stays
    ShmArena()  # the next transport start
    assert not orphan.exists() and live.exists()
    from miles_weights.plugin import _cleanup

    live.unlink()
    assert _cleanup(None) == 0


def test_an_interrupted_run_never_exits_0() -> None:
    from miles.loop.interrupts import exit_code_of, stop_requested

    async def run_until_stopped() -> str:
        with contextlib.suppress(asyncio.CancelledError):  # a cancellation swallowed inside the run ...
            await asyncio.sleep(60)
        return "interrupted" if stop_requested() else "completed"  # ... is still seen

    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    assert exit_code_of(lambda: asyncio.run(run_until_stopped())) == 128 + signal.SIGTERM
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    assert exit_code_of(lambda: asyncio.run(asyncio.sleep(60))) == 128 + signal.SIGINT
    assert exit_code_of(lambda: "completed") == 0 and exit_code_of(lambda: "failed") == 1


def test_a_step_in_which_every_sample_failed_stops_the_run() -> None:
    from miles.loop.rollout import StepRollout
    from miles.loop.runner import failed_step_error
    from miles_contracts import ExitReason, Sample, Status

    def step(*statuses: Status) -> StepRollout:
        samples = [Sample(prompt="p").finish(s, ExitReason.ENGINE_ERROR, "engine returned HTTP 400: top_k")
                   for s in statuses]
        return StepRollout([], samples)

    refused = failed_step_error(3, step(Status.FAILED, Status.ABORTED), previous_failed=False, last_step=False)
    assert refused is not None and "step 3: all 2 samples" in str(refused) and "top_k" in str(refused)
    aborted = step(Status.ABORTED, Status.ABORTED)  # engines restarting: one such step is skipped ...
    assert failed_step_error(3, aborted, previous_failed=False, last_step=False) is None
    assert failed_step_error(4, aborted, previous_failed=True, last_step=False) is not None  # ... not two
    assert failed_step_error(4, aborted, previous_failed=False, last_step=True) is not None  # nor the last
    assert failed_step_error(4, step(Status.FAILED, Status.COMPLETED), previous_failed=True, last_step=True) is None
