"""How ``miles chaos`` classifies a kill's recovery, on a real driver process that exits or lives on
and a real ledger file: a step recorded as trained just after a trainer rank's kill is the step that
was ending, not a recovery (the driver then fails and must be resumed); after an engine's kill, a
new engine process and a trained step are."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from miles.chaos.harness import HUNG, RESUME, SELF, UNFINISHED, Chaos, ChaosPlan, _Attempt
from miles.chaos.targets import ENGINE, TRAINER, Target


def _ledger(run_dir: Path, *states: str) -> None:
    (run_dir / "ledger").mkdir(exist_ok=True)
    with (run_dir / "ledger" / "events.jsonl").open("a") as f:
        for state in states:
            seq = sum(1 for _ in (run_dir / "ledger" / "events.jsonl").open()) + 1
            f.write(json.dumps({"seq": seq, "state": state}) + "\n")
            f.flush()


def _chaos(run_dir: Path) -> tuple[Chaos, list[str]]:
    chaos = Chaos(ChaosPlan(config=None, overrides=(), run_dir=run_dir, injections=1, recovery_timeout=30),
                  say=lambda _: None)
    started: list[str] = []
    chaos._start = lambda *, resume, extra=None: started.append("resume" if resume else "start")  # type: ignore[method-assign]
    chaos._wait_children_gone = lambda target, grace=30.0: None  # type: ignore[method-assign]
    return chaos, started


def _driver(code: str, tmp_path: Path) -> _Attempt:
    log = (tmp_path / "attempt.log").open("wb")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)  # as spawn() starts a driver: its own group
    return _Attempt(process, log, tmp_path / "attempt.log", mark=0)


def test_a_step_recorded_after_a_trainer_kill_is_not_a_recovery_the_driver_is_resumed(tmp_path: Path) -> None:
    _ledger(tmp_path, "drawn", "trained")
    mark = 2
    attempt = _driver("import time; time.sleep(1.5); raise SystemExit(2)", tmp_path)  # TrainerRankError's exit
    chaos, started = _chaos(tmp_path)
    ending = threading.Timer(0.5, _ledger, (tmp_path, "trained"))  # the step that was ending as the rank died
    ending.start()
    try:
        recovery = chaos._recover(attempt, Target(TRAINER, "trainer-0", 12345), mark, None)
    finally:
        ending.join()
        attempt.process.wait()
        attempt.log.close()
    assert recovery == RESUME
    assert started == ["resume"]
    assert chaos.failures == []


@pytest.mark.parametrize("replaced", [True, False])
def test_an_engine_kill_recovers_in_the_run_only_once_a_new_engine_process_is_followed_by_a_trained_step(
        tmp_path: Path, replaced: bool) -> None:
    (tmp_path / "services.json").write_text(json.dumps([{"name": "engine-0", "role": "engine", "pid": 222}]))
    _ledger(tmp_path, "drawn")
    attempt = _driver("import time; time.sleep(30)", tmp_path)
    chaos, started = _chaos(tmp_path)
    chaos.plan = ChaosPlan(config=None, overrides=(), run_dir=tmp_path, injections=1, recovery_timeout=3)
    if replaced:
        (tmp_path / "services.json").write_text(json.dumps([{"name": "engine-0", "role": "engine", "pid": 333}]))
    later = threading.Timer(1.0, _ledger, (tmp_path, "trained"))  # after the replacement was seen
    later.start()
    try:
        recovery = chaos._recover(attempt, Target(ENGINE, "engine-0", 222), 1, 222)
    finally:
        later.join()
        if attempt.process.poll() is None:
            attempt.process.kill()
        attempt.process.wait()
        attempt.log.close()
    if replaced:
        assert (recovery, started, chaos.failures) == (SELF, [], [])
    else:  # the old engine's pid still listed: no step counts, the run is declared hung and resumed
        assert recovery == HUNG and started == ["resume"]
        assert "neither progressed nor exited" in chaos.failures[0]


def test_a_recovery_cut_short_by_the_chaos_runs_own_time_limit_is_unfinished_not_hung(tmp_path: Path) -> None:
    """The 2026-12-03 soak: an engine killed 10 s before the soak's time limit was reported as hung
    "within 180 s". The run's time ran out, not the recovery's: the injection says so, no hang is
    counted and the driver is left alone (the time limit is the failure, reported once by _finish)."""
    (tmp_path / "services.json").write_text(json.dumps([{"name": "engine-0", "role": "engine", "pid": 222}]))
    _ledger(tmp_path, "drawn")
    attempt = _driver("import time; time.sleep(30)", tmp_path)
    chaos, started = _chaos(tmp_path)
    chaos.plan = ChaosPlan(config=None, overrides=(), run_dir=tmp_path, injections=1, recovery_timeout=180, timeout=1.0)
    try:
        recovery = chaos._recover(attempt, Target(ENGINE, "engine-0", 222), 1, 222)
    finally:
        attempt.process.kill()
        attempt.process.wait()
        attempt.log.close()
    assert (recovery, started, chaos.failures) == (UNFINISHED, [], [])
