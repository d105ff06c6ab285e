"""The set of workers and their state machine: every quarantine, admission and weight-version
decision is made here (no I/O; the health monitor, proxy and fan-out report what they saw).

Weight-version policy (see docs/design/router.md):

* the fleet's version starts as the newest version the workers it was started with report; from
  then on it follows the newest version a strict majority of the serving workers reported
  (numeric versions; it only moves forward), the version every serving worker agrees on (opaque
  versions), or what a weight update fanned out through the router set. A majority, not the
  newest: one worker (added later, say) claiming a version far ahead must not pin the fleet there
  and lock out every engine that restarts;
* a worker *joins* (first admission, re-admission after quarantine) only if its version is not
  behind the fleet's; otherwise it waits as ``STALE_WEIGHTS`` -- still probed and still sent
  fan-outs, so the next weight update brings it back;
* a serving worker whose numeric version goes *down* restarted with older weights: it is taken
  out the same way. Serving workers that merely lag during a weight sync keep serving (every
  response carries its ``weight_version``);
* a worker that failed a weight update fanned out through the router is taken out.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

from miles_router.versions import all_numeric, consensus, is_behind, is_newer, majority, went_backwards
from miles_router.workers import Worker, WorkerState, normalize_worker_url


class UnknownWorker(LookupError):
    """A URL that is not registered; the message lists those that are."""


class Fleet:
    """Workers by URL, the fleet's weight version and its pause state."""

    def __init__(self, *, failure_threshold: int, check_weight_version: bool = True) -> None:
        self.failure_threshold = failure_threshold
        self.check_weight_version = check_weight_version
        self.version: str | None = None
        # The body of the last /pause_generation fanned out, or None after /continue_generation;
        # a worker that joins is brought to the same state before it gets requests.
        self.pause_request: dict[str, Any] | None = None
        self.pause_known = False
        self.on_quarantine: Callable[[Worker], None] | None = None
        """Called with a worker as it is quarantined (the forwarder moves its requests elsewhere)."""
        self._workers: dict[str, Worker] = {}

    # ------------------------------------------------------------------ membership

    def add(self, url: str) -> tuple[Worker, bool]:
        """Register ``url`` (normalised); returns the worker and whether it is new."""
        url = normalize_worker_url(url)
        existing = self._workers.get(url)
        if existing is not None:
            return existing, False
        worker = self._workers[url] = Worker(url)
        return worker, True

    def remove(self, url: str) -> Worker:
        """Stop routing to ``url``; requests already running on it finish normally."""
        worker = self.get(url)
        del self._workers[worker.url]
        return worker

    def get(self, url: str) -> Worker:
        key = normalize_worker_url(url)
        worker = self._workers.get(key)
        if worker is None:
            known = ", ".join(self._workers) or "none"
            raise UnknownWorker(f"worker {key!r} is not registered (registered: {known})")
        return worker

    def __contains__(self, worker: object) -> bool:
        return isinstance(worker, Worker) and self._workers.get(worker.url) is worker

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def serving(self) -> list[Worker]:
        return [w for w in self._workers.values() if w.serving]

    def routable(self) -> list[Worker]:
        """Where a new request may go: serving workers that are not paused; when every serving
        worker is paused (a weight sync pauses them all at once) all of them, since an engine holds
        the request until generation continues (at most its ``paused_request_timeout``)."""
        serving = self.serving()
        return [w for w in serving if not w.paused] or serving

    def reachable(self) -> list[Worker]:
        """Workers that answer: those serving, and those held back for their weights."""
        return [w for w in self._workers.values() if w.state in (WorkerState.HEALTHY, WorkerState.STALE_WEIGHTS)]

    def counts(self) -> dict[str, int]:
        tally = collections.Counter(w.state.value for w in self._workers.values())
        return {state.value: tally.get(state.value, 0) for state in WorkerState}

    # ------------------------------------------------------------------ failures

    def record_failure(self, worker: Worker, error: str) -> None:
        """A probe or a connection to ``worker`` failed."""
        worker.consecutive_failures += 1
        worker.last_error = error
        failures = worker.consecutive_failures
        if worker.state is WorkerState.PENDING:
            worker.reason = f"not answering yet: {error}"
        elif worker.state is WorkerState.QUARANTINED or failures >= self.failure_threshold:
            newly = worker.state is not WorkerState.QUARANTINED
            worker.move_to(WorkerState.QUARANTINED, f"{failures} consecutive failures; last: {error}")
            if newly and self.on_quarantine is not None:
                self.on_quarantine(worker)

    def record_success(self, worker: Worker) -> None:
        """A request on ``worker`` got an answer."""
        worker.consecutive_failures = 0

    # ------------------------------------------------------------------ probes and versions

    def record_alive(self, worker: Worker, version: str | None) -> bool:
        """``worker`` answered a health probe reporting ``version``.

        Returns True when it is not serving yet and may join: the caller then calls :meth:`admit`.
        """
        worker.consecutive_failures = 0
        if worker.serving:
            self.observe_version(worker, version)
            return False
        worker.weight_version = version
        if self.check_weight_version and is_behind(version, self.version):
            worker.move_to(
                WorkerState.STALE_WEIGHTS,
                f"weight_version {version} is behind the fleet's {self.version}; it rejoins once it has "
                "the fleet's weights (weight updates fanned out through the router reach it too)",
            )
            return False
        return worker in self

    def admit(self, worker: Worker) -> None:
        if worker not in self or worker.serving:
            return
        worker.move_to(WorkerState.HEALTHY, None)
        worker.last_error = None
        self._follow_serving_versions()

    def observe_version(self, worker: Worker, version: str | None) -> None:
        """A serving worker reported ``version`` (in a probe or a generate response)."""
        previous, worker.weight_version = worker.weight_version, version
        if version is None:
            return
        if self.check_weight_version and worker.serving and went_backwards(previous, version):
            worker.move_to(
                WorkerState.STALE_WEIGHTS,
                f"weight_version went back from {previous} to {version}: the engine restarted without "
                "the fleet's weight updates",
            )
            return
        self._follow_serving_versions()

    def adopt_version(self, version: str) -> None:
        """A weight update fanned out through the router set the fleet to ``version``; serving
        workers left behind (their update failed) stop serving, held-back ones that caught up join."""
        self.version = version
        if not self.check_weight_version:
            return
        for worker in self._workers.values():
            behind = is_behind(worker.weight_version, version)
            if worker.serving and behind:
                worker.move_to(
                    WorkerState.STALE_WEIGHTS,
                    f"weight update to {version} did not reach it (it has {worker.weight_version})",
                )
            elif worker.state is WorkerState.STALE_WEIGHTS and not behind:
                # Reachable workers get every fan-out, so its pause state matches the fleet's.
                worker.move_to(WorkerState.HEALTHY, None)

    def seed_version(self, versions: list[str]) -> None:
        """Before the first admission: start from what the answering workers hold together, so a
        fleet found at mixed versions admits the newest and holds back the rest, whatever order
        the probes finish in. (These are the workers the router was started with: an operator's
        list, not a claim anyone could register.)"""
        if self.version is None and versions:
            self.version = consensus(versions)

    def _follow_serving_versions(self) -> None:
        versions = [w.weight_version for w in self.serving() if w.weight_version is not None]
        if not versions:
            return
        if all_numeric(versions):
            top = majority(versions)
            if is_newer(top, self.version):
                self.version = top
        elif len(set(versions)) == 1 or self.version is None:
            # Opaque versions have no order: follow them only when the serving workers agree.
            self.version = consensus(versions)

    # ------------------------------------------------------------------ pause state

    def record_pause(self, request: dict[str, Any] | None, workers: list[Worker] | None = None) -> None:
        """``/pause_generation`` (a body) or ``/continue_generation`` (None) reached the fleet
        (``workers``: those that took it)."""
        self.pause_request = request
        self.pause_known = True
        for worker in workers or ():
            worker.paused = request is not None

    def describe(self) -> dict[str, Any]:
        return {
            "fleet_weight_version": self.version,
            "paused": self.pause_request is not None,
            "counts": self.counts(),
        }
