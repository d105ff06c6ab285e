"""``miles chaos``: a real ``miles train`` run, SIGKILLed at random (seeded) times, recovered the way
a user would, then judged by its sample ledger.

One injection: wait a random gap, list the run's live processes (:mod:`miles.chaos.targets`), pick
a kind among those the run has (uniformly, then one process of it), SIGKILL it, and watch:

* **self**: the driver lives on and the run makes progress (a step's batch is recorded in the
  ledger after the kill; for a service, the executor has started a new process for it): the run
  recovered on its own (supervisor restarts, router failover, the reward pool's deadline).
* **resume**: the driver exited non-zero (a trainer rank or the driver itself was killed, or a
  component could only fail): ``miles train --resume RUN_DIR``, as a user would.
* **hung**: neither within ``recovery_timeout``: a bug. The driver is stopped and resumed so the
  soak goes on, and the chaos run fails.
* **unfinished**: the chaos run's own ``timeout`` ran out first, so the recovery was not seen: not
  a hang (the run fails for the time limit, which it reports once).

A run that completes before every injection is done is continued with ``--resume`` and more steps
(``extensions``): the ledger is built for exactly that. After the last injection the run is left
to finish (resumed again if it fails). Then ``miles.loop.ledger.summarize`` must show 0 lost and
0 duplicated prompts in every epoch, every driver that was not killed must have exited by itself,
and nothing may have hung. docs/design/async.md ("Fault injection").
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from miles.chaos.targets import DRIVER, KINDS, ROLLOUT_KINDS, Target, discover, kinds_present, services_of
from miles.errors import MilesError
from miles.executor.children import spawn

SELF, RESUME, HUNG, UNFINISHED = "self", "resume", "hung", "unfinished"
_POLL = 0.25
_LEDGER_TAIL = 256 << 10  # bytes of events.jsonl read to see recent progress


@dataclass(frozen=True)
class ChaosPlan:
    """What ``miles chaos`` does: the run's config, how many kills, which kinds, and its clocks.

    :ivar gap: seconds (low, high) waited before each kill, drawn uniformly with ``seed``.
    :ivar recovery_timeout: seconds a run may take to show progress after a kill it should survive.
    :ivar timeout: seconds the whole chaos run may take, the final finish included.
    """

    config: Path | None
    overrides: tuple[str, ...]
    run_dir: Path
    injections: int
    seed: int = 0
    kinds: tuple[str, ...] = KINDS
    gap: tuple[float, float] = (1.0, 6.0)
    recovery_timeout: float = 180.0
    timeout: float = 3600.0
    extend_steps: int = 4
    max_resumes: int | None = None  # kills of kinds that end the driver (trainer, driver); then rollout kinds only
    deterministic: bool = False  # run.deterministic; at the end, compare the final weights with a run without faults


@dataclass
class Injection:
    kind: str
    name: str
    pid: int
    at: float  # seconds since the chaos run began
    recovery: str = ""
    seconds: float = 0.0  # from the kill until the run (resumed if need be) trained a step again

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "name": self.name, "pid": self.pid, "at": round(self.at, 2),
                "recovery": self.recovery, "seconds": round(self.seconds, 2)}


@dataclass
class _Attempt:
    """One ``miles train`` process (the first start or a resume) and its log."""

    process: subprocess.Popen[bytes]
    log: IO[bytes]
    path: Path
    mark: int  # the ledger's last seq when it started: its own progress comes after
    killed: bool = False  # by us: its exit status says nothing about the run


@dataclass
class Chaos:
    plan: ChaosPlan
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    say: Callable[[str], None] = field(default=lambda text: print(f"miles chaos: {text}", file=sys.stderr, flush=True))

    def __post_init__(self) -> None:
        self.rng = random.Random(self.plan.seed)
        self.started = time.monotonic()
        self.injections: list[Injection] = []
        self.attempts: list[_Attempt] = []
        self.failures: list[str] = []
        self.extensions = 0
        self.seen_kinds: set[str] = set()
        self.steps = 0
        self.completed_early = False  # a deterministic run is not extended: more steps would change its schedule
        self.weights: dict[str, Any] | None = None

    # ------------------------------------------------------------------ the run

    def run(self) -> dict[str, Any]:
        from miles.config import load_config

        self.steps = load_config(self.plan.config, list(self.plan.overrides)).run.steps
        (self.plan.run_dir / "chaos").mkdir(parents=True, exist_ok=True)
        self._start(resume=False)
        try:
            while len(self.injections) < self.plan.injections and not self._out_of_time() \
                    and not self.completed_early:
                self._inject_one()
            self._finish()
        finally:
            self._stop_current()
        if self.plan.deterministic:
            self.weights = self._compare_with_reference()
        return self._report()

    def _compare_with_reference(self) -> dict[str, Any]:
        from miles.chaos.reference import run_reference

        name = f"{self.plan.run_dir.name}-reference"
        config = [str(self.plan.config)] if self.plan.config is not None else []
        argv = [*config, *self.plan.overrides, f"run.name={name}", f"run.steps={self.steps}"]
        self.say(f"running the same {self.steps} steps without faults ({name}) to compare the final weights")
        left = self.plan.timeout - (time.monotonic() - self.started)
        verdict = run_reference(argv, self.plan.run_dir, self.plan.run_dir.parent / name, self.steps, self.env, left)
        return verdict.to_json()

    def _inject_one(self) -> None:
        attempt = self.attempts[-1]
        targets = self._wait_for_targets(attempt)
        if targets is None:
            return  # the driver ended first (handled there); try again with the next one
        deadline = time.monotonic() + self.rng.uniform(*self.plan.gap)
        while time.monotonic() < deadline:
            if attempt.process.poll() is not None:
                self._driver_ended(attempt)
                return
            time.sleep(_POLL)
        targets = [t for t in discover(self.plan.run_dir, attempt.process.pid) if t.kind in self.plan.kinds]
        self.seen_kinds |= {t.kind for t in targets}
        fatal = sum(i.kind not in ROLLOUT_KINDS for i in self.injections)
        if self.plan.max_resumes is not None and fatal >= self.plan.max_resumes:
            targets = [t for t in targets if t.kind in ROLLOUT_KINDS]  # the budget of resumes is spent
        kinds = kinds_present(targets)
        if not kinds:
            return
        kind = self.rng.choice(kinds)
        target = self.rng.choice([t for t in targets if t.kind == kind])
        self._kill(attempt, target)

    def _kill(self, attempt: _Attempt, target: Target) -> None:
        mark = _ledger_seq(self.plan.run_dir)
        before = {str(row.get("name")): row.get("pid") for row in services_of(self.plan.run_dir)}
        injection = Injection(target.kind, target.name, target.pid, time.monotonic() - self.started)
        self.say(f"injection {len(self.injections) + 1}/{self.plan.injections}: SIGKILL {target.name} "
                 f"(pid {target.pid}, {target.kind})")
        try:
            os.kill(target.pid, signal.SIGKILL)
        except ProcessLookupError:
            return  # it ended between the listing and the kill: not an injection
        if target.kind == DRIVER:
            attempt.killed = True
        self.injections.append(injection)
        killed_at = time.monotonic()
        injection.recovery = self._recover(attempt, target, mark, before.get(target.name))
        if injection.recovery in (RESUME, HUNG):  # recovered once the resumed run trains a step
            self._wait_for_targets(self.attempts[-1])
        injection.seconds = time.monotonic() - killed_at
        self.say(f"  -> recovered: {injection.recovery} after {injection.seconds:.1f} s")

    def _recover(self, attempt: _Attempt, target: Target, mark: int, old_pid: object) -> str:
        # within the whole run's budget too: a recovery that outlasts it is reported, not waited for
        hang_at = time.monotonic() + self.plan.recovery_timeout
        deadline = min(hang_at, self.started + self.plan.timeout)
        replaced = False
        while time.monotonic() < deadline:
            code = attempt.process.poll()
            if code is not None:
                if code == 0 and not attempt.killed:
                    return SELF  # it finished the run despite the kill
                self._wait_children_gone(target)
                self._start(resume=True)
                return RESUME
            if not replaced and self._replaced(target, old_pid):
                replaced, mark = True, _ledger_seq(self.plan.run_dir)  # progress counts from the new process on
            if replaced and _trained_since(self.plan.run_dir, mark):
                return SELF
            time.sleep(_POLL)
        if deadline < hang_at:  # the chaos run's time ran out first (_finish says so): not seen to hang
            return UNFINISHED
        self.failures.append(f"{target.name} ({target.kind}) killed: the run neither progressed nor exited within "
                             f"{self.plan.recovery_timeout:.0f} s (log {attempt.path})")
        self._stop_current()
        self._start(resume=True)
        return HUNG

    def _replaced(self, target: Target, old_pid: object) -> bool:
        """A service's process was started again (its row in services.json names a new pid);
        reward workers are replaced inside the driver, which services.json does not list.

        A trainer rank is never replaced within a run (the driver fails with ``TrainerRankError``
        and is resumed), so after its kill no ledger line counts as progress: the step that was
        ending when the rank died may still be recorded as trained, and taking that for a recovery
        misread the driver's exit that followed as a failure without a kill (seen in the H200 soak,
        docs/benchmarks/chaos.md)."""
        if target.kind not in ROLLOUT_KINDS:
            return False
        if old_pid is None:
            return True
        rows = {str(row.get("name")): row.get("pid") for row in services_of(self.plan.run_dir)}
        return rows.get(target.name) not in (None, old_pid)

    def _finish(self) -> None:
        """Let the run end; resume it when it fails (as many times as it takes, within the timeout)."""
        while not self._out_of_time():
            attempt = self.attempts[-1]
            code = attempt.process.poll()
            if code is None:
                time.sleep(_POLL)
                continue
            if code == 0 and not attempt.killed:
                return
            self.failures.append(f"the run failed after the last injection with exit code {code} (log {attempt.path})")
            self._start(resume=True)
        self.failures.append(f"the chaos run did not finish within {self.plan.timeout:.0f} s")

    def _driver_ended(self, attempt: _Attempt) -> None:
        """The driver exited while no kill was being watched."""
        code = attempt.process.wait()
        if code == 0 and self.plan.deterministic:
            self.completed_early = True
        elif code == 0:  # completed before every injection was done: continue it with more steps
            self.extensions += 1
            # at least doubled: each extension is a full start-up, which costs more than many steps
            self.steps += max(self.plan.extend_steps, self.steps)
            self._start(resume=True, extra=[f"run.steps={self.steps}"])
        else:
            self.failures.append(f"the run failed with exit code {code} without a kill (log {attempt.path})")
            self._start(resume=True)

    # ------------------------------------------------------------------ processes

    def _start(self, *, resume: bool, extra: list[str] | None = None) -> None:
        if self.attempts:  # the attempt before has ended (or is ending on its parent-death signal)
            self.attempts[-1].log.close()
        n = len(self.attempts)
        path = self.plan.run_dir / "chaos" / f"attempt-{n:03d}.log"
        if resume:
            argv = ["train", "--resume", str(self.plan.run_dir), *(extra or [])]
        else:
            config = [str(self.plan.config)] if self.plan.config is not None else []
            argv = ["train", *config, *self.plan.overrides]
        log = path.open("wb")
        mark = _ledger_seq(self.plan.run_dir)
        process = spawn([sys.executable, "-m", "miles.cli.main", *argv], log=log, env=self.env)
        self.attempts.append(_Attempt(process, log, path, mark))
        self.say(f"{'resumed' if resume else 'started'} the run (pid {process.pid}, log {path})")

    def _wait_for_targets(self, attempt: _Attempt) -> list[Target] | None:
        """The run's processes once this driver has started them all (services.json names pids of
        its own tree), or None when the driver ended first."""
        while not self._out_of_time():
            if attempt.process.poll() is not None:
                self._driver_ended(attempt)
                return None
            targets = discover(self.plan.run_dir, attempt.process.pid)
            if len(targets) > 1 and _trained_since(self.plan.run_dir, attempt.mark):
                return targets
            time.sleep(_POLL)
        return None

    def _wait_children_gone(self, target: Target, grace: float = 30.0) -> None:
        """The killed driver's services end on their parent-death signal; a resume started while an
        old trainer rank still writes would race it."""
        pids = [row.get("pid") for row in services_of(self.plan.run_dir)]
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(isinstance(p, int) and _alive(p) for p in pids):
            time.sleep(_POLL)

    def _stop_current(self) -> None:
        attempt = self.attempts[-1] if self.attempts else None
        if attempt is None:
            return
        if attempt.process.poll() is None:
            attempt.killed = True
            os.killpg(attempt.process.pid, signal.SIGTERM)
            try:
                attempt.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(attempt.process.pid, signal.SIGKILL)
                attempt.process.wait()
        attempt.log.close()

    def _out_of_time(self) -> bool:
        return time.monotonic() - self.started > self.plan.timeout

    # ------------------------------------------------------------------ the verdict

    def _report(self) -> dict[str, Any]:
        from miles.loop.ledger import LedgerError, summarize

        try:
            ledger = summarize(self.plan.run_dir)
        except (LedgerError, OSError, ValueError) as exc:
            ledger = {"error": str(exc), "lost": None, "duplicated": None}
        failures = list(self.failures)
        if ledger.get("lost") != 0 or ledger.get("duplicated") != 0:
            failures.append(f"ledger: {ledger.get('lost')} lost, {ledger.get('duplicated')} duplicated")
        if len(self.injections) < self.plan.injections:
            why = " (the run completed first: raise run.steps)" if self.completed_early else ""
            failures.append(f"only {len(self.injections)} of {self.plan.injections} injections were made{why}")
        if self.weights is not None and not self.weights["final_weights_equal"]:
            failures.append(self.weights.get("error") or "the final weights differ from those of the run without faults")
        by_kind = Counter(i.kind for i in self.injections)
        recoveries = Counter(i.recovery for i in self.injections)
        absent = [kind for kind in self.plan.kinds if kind not in self.seen_kinds]
        return {
            "run_dir": str(self.plan.run_dir), "seed": self.plan.seed, "passed": not failures, "failures": failures,
            "seconds": round(time.monotonic() - self.started, 1),
            "injections": {"requested": self.plan.injections, "done": len(self.injections),
                           "by_kind": {kind: by_kind[kind] for kind in KINDS if by_kind[kind]}},
            "kinds_absent": {kind: "the run has no process of this kind" for kind in absent},
            "recoveries": {name: recoveries[name] for name in (SELF, RESUME, HUNG, UNFINISHED)},
            "resumes": len(self.attempts) - 1, "extensions": self.extensions,
            "ledger": {key: ledger.get(key) for key in ("status", "resumes", "lost", "duplicated", "trained",
                                                        "in_flight", "error") if key in ledger}
                      | {"epochs": [{k: e[k] for k in ("epoch", "trained", "dropped", "filtered", "lost",
                                                       "duplicated", "closed") if k in e}
                                    for e in ledger.get("epochs", [])]},
            "events": [i.to_json() for i in self.injections],
        } | ({"weights": self.weights} if self.weights is not None else {})


# ---------------------------------------------------------------------- the ledger, read live


def _ledger_lines(run_dir: Path) -> list[dict[str, Any]]:
    """The complete lines at the end of ``<run>/ledger/events.jsonl`` (compaction rewrites the file
    by rename, so reading it whole or its tail is always a consistent view)."""
    path = run_dir / "ledger" / "events.jsonl"
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - _LEDGER_TAIL))
            data = f.read()
    except OSError:
        return []
    lines = []
    for raw in data.splitlines()[1 if len(data) >= _LEDGER_TAIL else 0:]:
        try:
            line = json.loads(raw)
        except ValueError:
            continue  # cut short by a kill, or being written
        if isinstance(line, dict) and "seq" in line:
            lines.append(line)
    return lines


def _ledger_seq(run_dir: Path) -> int:
    return max((int(line["seq"]) for line in _ledger_lines(run_dir)), default=0)


def _trained_since(run_dir: Path, seq: int) -> bool:
    """A step's batch was recorded after line ``seq``: the loop went on."""
    return any(line.get("state") == "trained" and int(line["seq"]) > seq for line in _ledger_lines(run_dir))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_chaos(plan: ChaosPlan) -> dict[str, Any]:
    if plan.injections < 1:
        raise MilesError(f"--injections must be 1 or more, got {plan.injections}")
    unknown = sorted(set(plan.kinds) - set(KINDS))
    if unknown:
        raise MilesError(f"unknown kind(s) {', '.join(unknown)}; choose among {', '.join(KINDS)}")
    return Chaos(plan).run()


__all__ = ["HUNG", "RESUME", "SELF", "UNFINISHED", "Chaos", "ChaosPlan", "Injection", "run_chaos"]
