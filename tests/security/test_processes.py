"""Process-level guarantees: SIGTERM stops every server within seconds (even an engine blocked
joining a weight group, or one still starting), nothing a killed driver started outlives it, a
service whose port was taken comes up on another, a killed driver's shared-memory buckets do not
outlive the next start and are private, and an interrupted or failed run never exits 0."""

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
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from miles.errors import MilesError
from miles_contracts.testing.processes import LoggedProcess
from miles_contracts.wire.auth import auth_headers
from security_support import free_port
from torch.distributed import TCPStore

STOP_WITHIN_S = 10.0


def _start(argv: list[str], log: Path) -> tuple[LoggedProcess, str]:
    port = free_port()
    return LoggedProcess([*argv, "--port", str(port)], log, env={"HF_HUB_OFFLINE": "1"}).start(), \
        f"http://127.0.0.1:{port}"


@pytest.mark.slow
def test_sigterm_stops_each_server_within_seconds(tiny_dense: Path, tmp_path: Path) -> None:
    engine, engine_url = _start([sys.executable, "-m", "miles_engine", "--model", str(tiny_dense), "--device", "cpu",
                                 "--context-length", "64", "--weight-group-timeout", "600"], tmp_path / "engine.log")
    router, router_url = _start([sys.executable, "-m", "miles_router", "--worker", engine_url, "--request-timeout", "600"],
                                tmp_path / "router.log")
    session, session_url = _start([sys.executable, "-m", "miles_tito.server", "--router", router_url,
                                   "--model", str(tiny_dense), "--family", "chatml"], tmp_path / "session.log")
    processes = [engine, router, session]
    try:
        for process, url in zip(processes, (engine_url, router_url, session_url), strict=True):
            process.wait_healthy(url)
        # The engine blocks inside torch's C++ rendezvous of a weight group whose store this test
        # hosts but whose rank 0 never joins (600 s allowed); a request waits on it through the
        # router; a session request waits in the session server.
        store = TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=600), wait_for_workers=False)
        group = {"master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1, "world_size": 2,
                 "backend": "gloo"}
        pending = [threading.Thread(target=_quietly, args=(f"{engine_url}/init_weights_update_group", group), daemon=True)]
        pending[0].start()
        deadline = time.monotonic() + 60
        while store.num_keys() == 0 and time.monotonic() < deadline:  # until the engine wrote its address
            time.sleep(0.05)
        for process in processes:
            process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        for process in processes:
            process.wait_exit(deadline_s=STOP_WITHIN_S + 5)
        assert time.monotonic() - started < STOP_WITHIN_S
    finally:
        for process in processes:
            process.stop()


@pytest.mark.slow
def test_sigterm_stops_an_engine_that_is_still_starting(tiny_dense: Path, tmp_path: Path) -> None:
    """Signalled while it imports torch, loads the model or starts serving (staggered moments:
    before its stop handling exists the default action ends it, after, the deadline does)."""
    for delay in (0.0, 0.5, 1.5, 3.0, 6.0):
        engine, _ = _start([sys.executable, "-m", "miles_engine", "--model", str(tiny_dense), "--device", "cpu"],
                           tmp_path / f"engine-{delay}.log")
        try:
            time.sleep(delay)  # when the signal comes is what this test varies
            engine.send_signal(signal.SIGTERM)
            started = time.monotonic()
            engine.wait_exit(deadline_s=STOP_WITHIN_S + 5)
            assert time.monotonic() - started < STOP_WITHIN_S, f"signalled {delay} s after its start"
        finally:
            engine.stop()


@pytest.mark.slow
def test_a_killed_driver_leaves_no_process_behind(tiny_dense: Path, tmp_path: Path) -> None:
    """Five driver-like parents, started at once (a loaded machine), each with a real engine and
    router from the local executor, are SIGKILLed in five phases (children importing, idle,
    generating, blocked in a weight-group join, just restarted by the supervisor thread): every
    child is gone soon after (``driver_kill.py``; its soak runs many more trials)."""
    from driver_kill import PHASES, run_trials

    trials = run_trials([(phase, signal.SIGKILL) for phase in PHASES], tiny_dense, tmp_path)
    assert [t.survivors for t in trials] == [[]] * len(PHASES)
    assert all(t.children == 2 and t.gone_s is not None for t in trials), trials


@pytest.mark.slow
def test_a_stopped_driver_stops_its_children_together(tiny_dense: Path, tmp_path: Path) -> None:
    """SIGTERM to the parent: it stops its engine and router at once, and each is gone within its
    own deadline (an idle engine used to spend 4-6 s after its stop in interpreter finalization,
    and the services were stopped one after another)."""
    from driver_kill import run_trials

    trials = run_trials([("idle", signal.SIGTERM), ("busy", signal.SIGTERM)], tiny_dense, tmp_path)
    assert all(t.gone_s is not None and t.gone_s < STOP_WITHIN_S for t in trials), trials


@pytest.mark.slow
def test_an_engine_whose_port_was_taken_is_started_again_on_another_port(tiny_dense: Path, tmp_path: Path) -> None:
    """Another process takes the port between the executor's choice and the engine's bind: the
    engine exits with EXIT_ADDRESS_IN_USE and the executor starts it on a port it picks anew."""
    import socket

    from miles.executor.local import LocalExecutor
    from miles_engine.launcher import engine_argv

    squatter = socket.socket()
    taken: list[int] = []

    def command(endpoint: Any) -> list[str]:
        if not taken:  # the first start only: a process takes its port just before it listens
            squatter.bind((endpoint.host, endpoint.port))
            squatter.listen()
            taken.append(endpoint.port)
        return engine_argv(str(tiny_dense), port=endpoint.port, extra=["--device", "cpu"])

    executor = LocalExecutor(tmp_path, startup_timeout=600)
    try:
        executor.launch("engine-0", command, health_path="/health", env={"OMP_NUM_THREADS": "1"})
        executor.wait_healthy("engine-0")
        endpoint = executor.endpoint("engine-0")
        assert endpoint.port != taken[0]
        answer = httpx.post(f"{endpoint.url}/generate", headers=auth_headers(), timeout=120, trust_env=False,
                            json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
        assert answer.status_code == 200 and len(answer.json()["output_ids"]) == 2
        log = (tmp_path / "logs" / "engine-0.log").read_text()
        assert f"port {taken[0]} was taken by another process" in log and "already in use" in log
    finally:
        executor.shutdown()
        squatter.close()


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
    from miles.context import context_for
    from miles_weights.plugin import _cleanup

    live.unlink()
    assert _cleanup(None, context_for()) == 0


def test_an_interrupted_run_never_exits_0() -> None:
    from miles.loop.interrupts import exit_code_of, stop_requested

    async def run_until_stopped() -> str:
        with contextlib.suppress(asyncio.CancelledError):  # a cancellation swallowed inside the run ...
            await asyncio.sleep(60)
        return "interrupted" if stop_requested() else "completed"  # ... is still seen

    statuses: list[str] = []

    def run() -> str:
        statuses.append(asyncio.run(run_until_stopped()))
        return statuses[-1]

    # SIGINT as an interactive Python has it: a suite started in the background has it ignored, and
    # then the SIGTERM below cancelled nothing (the sleep ran its 60 s and the run "completed")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        assert exit_code_of(run) == 128 + signal.SIGTERM
        assert statuses == ["interrupted"]  # the SIGTERM did stop the run
        # Ctrl-C
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        assert exit_code_of(lambda: asyncio.run(asyncio.sleep(60))) == 128 + signal.SIGINT
    finally:
        signal.signal(signal.SIGINT, previous)
    assert exit_code_of(lambda: "completed") == 0 and exit_code_of(lambda: "failed") == 1


def _step(*statuses: Any) -> Any:
    from miles.loop.rollout import StepRollout
    from miles_contracts import ExitReason, Sample

    samples = [Sample(prompt="p").finish(s, ExitReason.ENGINE_ERROR, f"engine said {s.value}") for s in statuses]
    return StepRollout([], samples, {"time/rollout": 1.0})


def test_a_step_in_which_every_sample_failed_stops_the_run() -> None:
    from miles.loop.steps import failed_step_error
    from miles_contracts import Status

    refused = failed_step_error(3, _step(Status.FAILED, Status.ABORTED), retried=False)
    assert refused is not None and "step 3: all 2 samples" in str(refused) and "engine said failed" in str(refused)
    aborted = _step(Status.ABORTED, Status.ABORTED)  # engines restarting: the step is collected again ...
    assert failed_step_error(3, aborted, retried=False) is None
    again = failed_step_error(3, aborted, retried=True)  # ... and a second attempt aborted too stops the run
    assert again is not None and "second attempt" in str(again)
    assert failed_step_error(4, _step(Status.FAILED, Status.COMPLETED), retried=True) is None


def test_a_step_whose_samples_were_all_aborted_is_collected_again_after_a_health_probe(tmp_path: Path) -> None:
    """The step operations' side of an engine lost mid-rollout (the end-to-end tests kill real
    engines at a point they choose, this one walks every branch): the step waits for engines that
    answer a health probe, gives a restarted engine the trainer's weights (or first pushes a
    one_step_off update that was waiting), collects again and dumps both attempts; a second
    aborted attempt stops the run, its samples dumped too."""
    from miles.config import load_config
    from miles.context import context_for
    from miles.loop.engine_memory import EngineMemory
    from miles.loop.progress import Progress
    from miles.loop.steps import RunState, StepOps
    from miles_contracts import Status

    events: list[str] = []

    class Services:  # the part of miles.loop.services.Services the step operations use here
        stale_engines: set[str] = set()

        def wait_ready(self, timeout: float, *, router: bool = False, probe: bool = False) -> float:
            events.append("wait router" if router else f"wait engines{' (probe)' if probe else ''}")
            if probe:  # the supervisor restarted the dead engine meanwhile
                self.stale_engines.add("engine-0")
            return 0.0

    class Rollout:
        def __init__(self, *results: Any) -> None:
            self.results = list(results)

        async def collect(self, step: int, progress: Any = None, *, recover: Any = None) -> Any:
            events.append("collect")
            return self.results.pop(0)

    services = Services()

    def sync_weights(*, bump: bool = True) -> dict[str, float]:
        events.append("sync" if bump else "resync")
        restarted = len(services.stale_engines)
        services.stale_engines.clear()
        return {"time/sync": 0.5, "weights/engines_restarted": float(restarted), "weights/version": 2.0}

    config = load_config(None)
    ops = StepOps(config=config, kernel=context_for(config).kernel, run_dir=tmp_path, state=RunState(2, 2),
                  progress=Progress(3), rollouts=Rollout(_step(Status.ABORTED, Status.ABORTED),
                                                         _step(Status.COMPLETED, Status.ABORTED)),
                  learner=None, trainer=None, services=services, metrics=None, eval_prompts=[],  # type: ignore[arg-type]
                  engine_memory=EngineMemory("none", services))  # type: ignore[arg-type]
    ops.sync_weights = sync_weights  # type: ignore[method-assign]  # no trainer here: record the pushes
    rollout = asyncio.run(ops.rollout_step(2))
    assert events == ["wait engines", "wait router", "collect",  # the first attempt
                      "wait engines (probe)", "resync", "wait router", "collect"]  # the restarted engine synced first
    assert [s.status for s in rollout.all_samples] == [Status.ABORTED, Status.ABORTED, Status.COMPLETED, Status.ABORTED]
    assert rollout.metrics["rollout/recollected"] == 1.0 and rollout.metrics["time/rollout"] >= 1.0
    assert rollout.metrics["weights/resynced_engines"] == 1.0

    # one_step_off: the update that waited for this rollout is pushed before generating again
    events.clear()
    ops.rollouts = Rollout(_step(Status.ABORTED), _step(Status.ABORTED, Status.ABORTED))  # type: ignore[assignment]
    pushed: list[bool] = []

    def deferred_push() -> dict[str, float]:
        pushed.append(True)
        return sync_weights()

    with pytest.raises(MilesError, match="step 3: all 2 samples were aborted or failed in a second attempt"):
        asyncio.run(ops.rollout_step(3, before_retry=deferred_push))
    assert events[3:5] == ["sync", "wait engines (probe)"] and pushed == [True]
    dumped = (tmp_path / "samples" / "step_000003.jsonl").read_text().splitlines()
    assert len(dumped) == 3  # the first attempt's sample and the second's two
