"""``miles chaos`` finds what to kill in the real process tree: a stand-in driver (a Python process
that starts a service child and a ``multiprocessing`` spawn pool, as the driver's reward pool does)
and the run folder's services.json naming its children."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from miles.chaos.targets import DRIVER, REWARD_WORKER, TRAINER, discover, kinds_present

DRIVER_CODE = """
import multiprocessing, subprocess, sys, time
if __name__ == "__main__":
    service = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pool = multiprocessing.get_context("spawn").Pool(1)
    pool.apply(abs, (-1,))  # the worker is up
    print(service.pid, flush=True)
    time.sleep(60)
"""


def test_discover_lists_the_driver_its_services_and_reward_workers_and_nothing_outside_its_tree(
        tmp_path: Path) -> None:
    driver = subprocess.Popen([sys.executable, "-c", DRIVER_CODE], stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout is not None
        service = int(driver.stdout.readline())
        outsider = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # not the driver's
        try:
            rows = [{"name": "trainer-0", "pid": service}, {"name": "router", "role": "router", "pid": outsider.pid},
                    {"name": "engine-0", "role": "engine", "pid": None}]
            (tmp_path / "services.json").write_text(json.dumps(rows))
            targets = discover(tmp_path, driver.pid)
        finally:
            outsider.kill()
            outsider.wait()
        by_kind = {t.kind: t for t in targets}
        assert by_kind[DRIVER].pid == driver.pid and by_kind[TRAINER].pid == service
        assert kinds_present(targets) == [TRAINER, REWARD_WORKER, DRIVER]  # the router's pid is not in the tree
        worker = by_kind[REWARD_WORKER]
        assert worker.name == f"reward-worker-{worker.pid}"
    finally:
        driver.kill()
        driver.wait()
        with contextlib.suppress(ProcessLookupError, UnboundLocalError):
            os.kill(service, signal.SIGKILL)  # the stand-in has no parent-death signal
    deadline = time.monotonic() + 10
    while discover(tmp_path, driver.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert discover(tmp_path, driver.pid) == []  # a driver that is gone has nothing to kill


def test_deterministic_chaos_refuses_kinds_that_are_not_rollout_and_reads_the_last_digest(tmp_path: Path) -> None:
    """``miles chaos --deterministic`` claims equal final weights for rollout faults only: other
    kinds are refused with the kinds to use; the digest compared is the last step's record (a
    resume's superseded record is in another file)."""
    import pytest
    from miles.chaos.reference import check_deterministic_kinds, last_step_digest
    from miles.errors import MilesError

    check_deterministic_kinds(("engine", "router", "reward_worker"))
    with pytest.raises(MilesError, match=r"--kinds has trainer, driver: use --kinds engine,router,session"):
        check_deterministic_kinds(("engine", "trainer", "driver"))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/weights_digest": 5.0}\n{"step": 2, "train/weights_digest": 7.0}\n'
                                            '{"step": 2, "train/weights_digest": 9.0}\n{"step": 3, "tr')
    assert last_step_digest(tmp_path, 2) == 9.0 and last_step_digest(tmp_path, 3) is None
    assert last_step_digest(tmp_path / "missing", 1) is None
