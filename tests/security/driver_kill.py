"""A driver-like parent that starts a real engine and a real router through the local executor,
and what is left of them after the parent is killed (SIGKILL) or stopped (SIGTERM).

Used by ``test_processes.py`` (a few trials) and, run as a script, as the soak behind
``docs/benchmarks/processes.md`` (many trials, optionally beside CPU burners that load the machine)::

    uv run python tests/security/driver_kill.py --trials 20 --real-runs 4 > docs/benchmarks/processes-cpu.json

Trials run in batches, one parent (``python driver_kill.py --parent ...``) per phase started at
once; each is signalled as soon as it reports the phase it was told to reach, and ``/proc`` is
polled until none of the process groups of its children has a live member, up to a bound.
Batches alternate SIGKILL and SIGTERM. Phases:

* ``starting``: right after the executor launched both (the children are still importing);
* ``idle``: both healthy, nothing to do;
* ``busy``: generation requests in flight through the router;
* ``joining``: the engine blocked in a weight-group join (the parent hosts the store but never
  joins: the engine waits inside torch's C++ rendezvous);
* ``restarting``: the engine was killed and the executor's supervisor thread started it again
  (the child's parent-death signal must not depend on the thread that forked it).

``--real-runs N`` adds runs of ``miles train`` itself (CPU, tiny model), signalled once they
logged step 2, as in the report that started this (issue 33, item 8).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

PHASES = ("starting", "idle", "busy", "joining", "restarting")
GONE_WITHIN_S = 60.0
"""How long a trial waits for the children to go (a generous bound, not a measurement)."""


@dataclass
class Trial:
    phase: str
    signal: str
    children: int  # process groups the parent started
    gone_s: float | None  # seconds from the signal until no member of them was alive (None: not within the bound)
    survivors: list[str]  # "pid cmdline" of what was still alive at the bound


# ------------------------------------------------------------------ the parent (a child of the test)


def _parent(phase: str, model: str, run_dir: Path) -> None:
    from miles.executor.local import LocalExecutor
    from miles_contracts.wire.auth import auth_headers, ensure_run_token
    from miles_engine.launcher import engine_argv
    from miles_router import router_command

    ensure_run_token()
    executor = LocalExecutor(run_dir, startup_timeout=600)
    stopped = threading.Event()

    def on_sigterm(signum: int, frame: object) -> None:  # what `miles train` does on SIGTERM, in short
        stopped.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    env = {"OMP_NUM_THREADS": "1"}
    engine = executor.launch("engine-0", lambda e: engine_argv(model, port=e.port, extra=[
        "--device", "cpu", "--context-length", "512", "--weight-group-timeout", "600"]), health_path="/health", env=env)
    router = executor.launch("router", lambda e: router_command([engine.url], port=e.port, extra=[
        "--health-interval", "0.2"]), env=env)

    def report(state: str) -> None:
        print(json.dumps({"state": state, "pids": [row["pid"] for row in executor.manifest()]}), flush=True)

    if phase != "starting":
        executor.wait_healthy("engine-0")
        client = httpx.Client(timeout=600, headers=auth_headers(), trust_env=False)
        _wait(lambda: client.get(f"{router.url}/health").status_code == 200)
        if phase == "busy":
            body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
            for _ in range(8):
                threading.Thread(target=_quietly, args=(client, f"{router.url}/generate", body), daemon=True).start()
            _wait(lambda: client.get(f"{router.url}/list_workers").json()["workers"][0]["in_flight"] > 0)
        elif phase == "joining":
            from datetime import timedelta

            import torch.distributed as dist

            store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=600),
                                  wait_for_workers=False)
            join = {"master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1, "world_size": 2,
                    "backend": "gloo", "group_name": "never-completed"}
            threading.Thread(target=_quietly, args=(client, f"{engine.url}/init_weights_update_group", join),
                             daemon=True).start()
            _wait(lambda: store.num_keys() > 0)  # the engine is in (it wrote its address)
        elif phase == "restarting":
            restarted = threading.Event()

            def on_death(name: str) -> None:  # on the supervisor's thread, as in a run
                executor.restart(name, wait=False)
                restarted.set()

            executor.supervise(on_death, interval=0.2)
            os.kill(executor.manifest()[0]["pid"], signal.SIGKILL)
            restarted.wait(120)
    report("ready")
    # with a timeout: a signal the kernel hands to another thread does not interrupt the main
    # thread's wait, and Python runs handlers only on the main thread (it once waited forever)
    while not stopped.wait(0.1):
        pass
    executor.shutdown()


def _quietly(client: httpx.Client, url: str, body: dict[str, Any]) -> None:
    with contextlib.suppress(httpx.HTTPError):  # the run is being torn down under it
        client.post(url, json=body)


def _wait(condition: Callable[[], bool], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except Exception:  # not answering yet
            pass
        time.sleep(0.1)
    raise TimeoutError("the parent's setup did not complete")


# ------------------------------------------------------------------ the trial (in the test process)


def live_members(pgid: int) -> list[str]:
    """``"pid cmdline"`` of every live (not zombie) process of process group ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            found.append(f"{entry.name} {cmdline[:160]}")
    return found


class Parent:
    """One driver-like parent process, told to reach ``phase`` and then signalled."""

    def __init__(self, phase: str, model: Path, run_dir: Path) -> None:
        self.phase = phase
        self.run_dir = run_dir
        self.pgids: list[int] = []  # each child leads its own process group
        self.process = subprocess.Popen([sys.executable, __file__, "--parent", phase, "--model", str(model),
                                         "--run-dir", str(run_dir)], stdout=subprocess.PIPE, text=True,
                                        env={**os.environ, "HF_HUB_OFFLINE": "1"})

    def wait_ready(self) -> None:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the parent of phase {self.phase!r} exited with {self.process.wait()} before it "
                               f"was ready; logs in {self.run_dir / 'logs'}")
        self.pgids = [int(pid) for pid in json.loads(line)["pids"] if pid]

    def signal(self, sig: signal.Signals, bound: float = GONE_WITHIN_S) -> Trial:
        """Send ``sig``; how long until none of its children's groups has a live member (the
        parent's own exit is not timed)."""
        self.process.send_signal(sig)
        gone, survivors = _gone_within(self.pgids, bound)
        self.process.wait(timeout=bound)
        return Trial(self.phase, sig.name, len(self.pgids), gone, survivors)

    def survivors(self) -> list[str]:
        return [member for pgid in self.pgids for member in live_members(pgid)]

    def kill_all(self) -> None:
        """Whatever a failed trial left must not outlive it."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for pgid in self.pgids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)


def _gone_within(pgids: list[int], bound: float) -> tuple[float | None, list[str]]:
    """Seconds until no group of ``pgids`` has a live member (None after ``bound``), and what was
    still alive then."""
    signalled = time.monotonic()
    survivors = [m for g in pgids for m in live_members(g)]
    while survivors and time.monotonic() - signalled < bound:
        time.sleep(0.02)
        survivors = [m for g in pgids for m in live_members(g)]
    return (None if survivors else time.monotonic() - signalled), survivors


def run_trials(cases: list[tuple[str, signal.Signals]], model: Path, work_dir: Path) -> list[Trial]:
    """Start one parent per case at once (so they load the machine together) and signal each as
    soon as it is in its phase (``starting`` at once, while its children and the others import)."""
    parents = [Parent(phase, model, work_dir / f"{i}-{phase}") for i, (phase, _) in enumerate(cases)]
    trials = []
    try:
        for parent, (_, sig) in zip(parents, cases, strict=True):
            parent.wait_ready()
            trials.append(parent.signal(sig))
        return trials
    finally:
        for parent in parents:
            parent.kill_all()


def real_run_trial(sig: signal.Signals, model: Path, work_dir: Path, *, step: int = 2,
                   bound: float = GONE_WITHIN_S) -> Trial:
    """``miles train`` on CPU (tiny model: trainer rank, engine, router), signalled once it has
    logged ``step``; its processes are read from ``<run>/services.json``."""
    run = work_dir / "run"
    argv = [sys.executable, "-m", "miles.cli.main", "train", f"model.name={model}", f"run.output_dir={work_dir}",
            "run.name=run", "run.steps=1000", "run.save_every=0", "run.save_final=false",
            "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=12",
            "reward.name=f1", "data.options={digits: 1}"]
    work_dir.mkdir(parents=True, exist_ok=True)
    with (work_dir / "driver.log").open("wb") as log:
        driver = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    pgids: list[int] = []
    try:
        _wait(lambda: driver.poll() is None and _logged_step(run) >= step, timeout=1800)
        pgids = [int(row["pid"]) for row in json.loads((run / "services.json").read_text()) if row.get("pid")]
        driver.send_signal(sig)
        gone, survivors = _gone_within(pgids, bound)
        driver.wait(timeout=bound)
        return Trial(f"miles train, step {step}", sig.name, len(pgids), gone, survivors)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        for pgid in pgids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)


def _logged_step(run: Path) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return max((int(json.loads(line).get("step", 0)) for line in lines if line.strip()), default=0)


# ------------------------------------------------------------------ the soak


def soak(trials: int, real_runs: int, burners: int, work_dir: Path) -> dict[str, Any]:
    from miles_models.testing import tiny_model

    model = tiny_model("dense")
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
    results: list[Trial] = []

    def record(trial: Trial) -> None:
        results.append(trial)
        print(json.dumps(asdict(trial)), file=sys.stderr, flush=True)

    try:
        for batch in range(0, trials, len(PHASES)):
            sig = (signal.SIGKILL, signal.SIGTERM)[(batch // len(PHASES)) % 2]
            cases = [(phase, sig) for phase in PHASES][: trials - batch]
            for trial in run_trials(cases, model, work_dir / f"batch-{batch}"):
                record(trial)
        for i in range(real_runs):
            record(real_run_trial((signal.SIGKILL, signal.SIGTERM)[i % 2], model, work_dir / f"run-{i}"))
    finally:
        for process in load:
            process.kill()
    return {"command": " ".join(["uv run python tests/security/driver_kill.py", *sys.argv[1:]]),
            "cpus": os.cpu_count(), "burners": burners, **summarize(results)}


def summarize(results: list[Trial]) -> dict[str, Any]:
    """Trials per (signal, phase): how many left a child behind, median and worst seconds until
    every child was gone."""
    by_case: dict[str, Any] = {}
    for phase, sig in sorted({(t.phase, t.signal) for t in results}):
        group = [t for t in results if t.phase == phase and t.signal == sig]
        times = [t.gone_s for t in group if t.gone_s is not None]
        by_case[f"{sig} {phase}"] = {"trials": len(group), "left_children": len(group) - len(times),
                                     "gone_s_median": round(statistics.median(times), 3) if times else None,
                                     "gone_s_max": round(max(times), 3) if times else None}
    return {"trials": len(results), "left_children": sum(t.gone_s is None for t in results), "by_case": by_case,
            "survivors": [s for t in results for s in t.survivors]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parent", choices=PHASES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--trials", type=int, default=20, help="driver-like parents (batches of one per phase)")
    parser.add_argument("--real-runs", type=int, default=0,
                        help="`miles train` runs signalled at step 2 (SIGKILL and SIGTERM in turn)")
    parser.add_argument("--burners", type=int, default=0, help="busy-loop processes loading the CPUs meanwhile")
    parser.add_argument("--work-dir", default=None, help="where the trials' run folders go (default: a temp dir)")
    args = parser.parse_args()
    if args.parent:
        _parent(args.parent, args.model, Path(args.run_dir))
        return
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(soak(args.trials, args.real_runs, args.burners, Path(args.work_dir or tmp)), indent=2))


if __name__ == "__main__":
    main()
