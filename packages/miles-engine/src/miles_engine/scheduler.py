"""Continuous batching: one thread that admits, prefills, decodes and retires requests.

Every iteration of the loop: run queued control jobs (abort, pause, weight updates ... they
touch the model and the cache only here, between two forwards), admit waiting requests while
there is room (prefilling each and sampling its first token), then one decode step for every
running request. A request joins at the next iteration after it arrives and leaves as soon as it
finishes, so the batch changes at every step.

Failures stay local: a batched prefill that fails is retried request by request, so only the
request that fails alone is aborted; a batched draw that fails is redone row by row, so only the
row whose sampling fails is aborted; a decode forward that fails aborts the requests of that step
(the only ones whose state is in doubt); the loop keeps serving. Every finish goes through
``on_finish``, so no caller waits forever.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from miles_contracts.wire.engine import FinishReason, PauseMode

from miles_engine.codec import TextCodec
from miles_engine.config import EngineConfig
from miles_engine.loading import LoadedModel
from miles_engine.memory import MemoryOccupation
from miles_engine.runner import ModelRunner
from miles_engine.sampling import sample
from miles_engine.sequence import Sequence
from miles_engine.stopping import StopChecker

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class SchedulerStats:
    """Counters a caller can read (``/get_server_info``) to see how the engine batched."""

    decode_steps: int = 0
    decode_tokens: int = 0  # sum over steps of the batch size
    max_decode_batch: int = 0
    prefill_requests: int = 0
    prefill_forwards: int = 0  # < prefill_requests when new requests were prefilled together
    prefill_tokens: int = 0
    cached_prefill_tokens: int = 0  # prompt tokens copied from the prefix cache instead of prefilled
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    step_errors: int = 0
    decode_seconds: float = 0.0  # wall time of decode steps (forward + sampling), for roofline maths
    prefill_seconds: float = 0.0
    gathered_waits: int = 0  # arrivals awaited by an idle engine before prefilling (prefill_wait_ms)

    def as_dict(self) -> dict[str, Any]:
        mean = self.decode_tokens / self.decode_steps if self.decode_steps else 0.0
        return {"decode_steps": self.decode_steps, "decode_tokens": self.decode_tokens,
                "mean_decode_batch": round(mean, 3), "max_decode_batch": self.max_decode_batch,
                "prefill_requests": self.prefill_requests, "prefill_forwards": self.prefill_forwards,
                "prefill_tokens": self.prefill_tokens, "cached_prefill_tokens": self.cached_prefill_tokens,
                "finished": dict(self.finished), "step_errors": self.step_errors,
                "decode_seconds": round(self.decode_seconds, 6), "prefill_seconds": round(self.prefill_seconds, 6),
                "gathered_waits": self.gathered_waits}


class Scheduler:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, max_kv_tokens: int) -> None:
        import torch

        self.config = config
        self.max_kv_tokens = max_kv_tokens
        # true on-policy: the model's linears are the invariant ones already (loading.py), not packed
        self.runner = ModelRunner(loaded, config.max_running_requests,
                                  pack_linears=not (config.plain_linear or config.true_on_policy),
                                  cuda_graphs=not config.disable_cuda_graph,
                                  batch_invariant=config.enable_deterministic_inference,
                                  prefix_cache_tokens=prefix_cache_tokens(config, max_kv_tokens))
        self.codec = TextCodec(loaded.tokenizer)
        self.stop_checker = StopChecker(self.codec)
        self.generator = torch.Generator(device=loaded.device).manual_seed(config.seed)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # running[i] lives in KV slot i
        self.paused = False
        self.paused_since = 0.0  # perf_counter() when the current pause began
        self.memory = MemoryOccupation(self)  # what /release_memory_occupation gave back
        self.weight_version = "0"
        self.stats = SchedulerStats()
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="miles-engine-scheduler", daemon=True)
        self._loop_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ called from other threads

    def start(self) -> None:
        """Run the loop on a background thread (the in-process default)."""
        self._thread.start()

    def run(self, until: threading.Event | None = None) -> None:
        """Run the loop on the calling thread until :meth:`stop` (or ``until`` is set).

        Prefer the process's main thread: with libgomp, OpenMP regions started from a secondary
        thread ran ~40% slower here once the main thread had used OpenMP (model loading does),
        measured on a batch-8 decode step; ``miles serve engine`` therefore serves HTTP from a
        helper thread and schedules on the main one.
        """
        self._loop_thread = threading.current_thread()
        self._loop(until)

    @property
    def alive(self) -> bool:
        thread = self._loop_thread
        return thread is not None and thread.is_alive() and not self._stopping

    @property
    def stopped(self) -> bool:
        return self._stopping

    def submit(self, seq: Sequence) -> None:
        self.call(lambda: self.waiting.append(seq))

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the scheduler thread between two forwards; its result or exception
        lands in the returned future."""
        future: Future[T] = Future()

        def job() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller, who reports it
                future.set_exception(exc)

        self._jobs.put(job)
        self._wakeup.set()
        return future

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is in flight and end the loop (joins it when it runs on a background thread)."""
        if self._stopping:
            return
        self.call(lambda: self.abort(None, "the engine is shutting down"))
        self._stopping = True
        self._wakeup.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ scheduler thread only

    def abort(self, rid: str | None, message: str) -> int:
        """Abort the request ``rid`` (every request when None); returns how many."""
        hits = [s for s in [*self.waiting, *self.running] if rid is None or s.rid == rid]
        for seq in hits:
            seq.abort(message)
        self.waiting = deque(s for s in self.waiting if not s.finished)
        for seq in hits:
            if seq not in self.running:
                self._deliver(seq)
        self._retire_finished()
        return len(hits)

    def pause(self, mode: PauseMode) -> None:
        if mode == "abort":
            self.abort(None, "aborted by /pause_generation")
        elif mode == "retract":
            # Keep the tokens, drop the KV: on continue each request is prefilled again with
            # everything it has so far and goes on decoding (with the weights of that time).
            for slot in range(len(self.running) - 1, -1, -1):
                seq = self.running[slot]
                if self.runner.prefix is not None:  # keep its KV: it resumes from the prefix cache
                    self.runner.prefix.leave(seq, slot, keep=True)
                seq.kv_len = 0
                self.waiting.appendleft(seq)
            self.running.clear()
            self.runner.cache.release()
        if not self.paused:
            self.paused_since = time.perf_counter()
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def _expire_paused_waits(self) -> None:
        """Abort requests that have waited on this pause longer than ``paused_request_timeout``."""
        limit = self.config.paused_request_timeout
        now = time.perf_counter()
        late = [s for s in [*self.waiting, *self.running] if now - max(s.created, self.paused_since) > limit]
        if not late:
            return
        for seq in late:
            seq.abort(f"the engine has been paused for more than {limit:g} s (paused_request_timeout); "
                      "nobody continued generation")
        self.waiting = deque(s for s in self.waiting if not s.finished)
        for seq in late:
            if seq not in self.running:
                self._deliver(seq)
        self._retire_finished()

    def flush_cache(self) -> bool:
        """Drop the KV cache; as SGLang, only when no request is queued or running (False then)."""
        if self.has_work():
            return False
        self.runner.cache.release()
        if self.runner.prefix is not None:
            self.runner.prefix.invalidate()
        return True

    @property
    def held(self) -> bool:
        """Paused, or memory released: nothing is admitted or decoded."""
        return self.paused or self.memory.holding

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _loop(self, until: threading.Event | None = None) -> None:
        if self._loop_thread is None:
            self._loop_thread = threading.current_thread()
        while not self._stopping and not (until is not None and until.is_set()):
            self._wakeup.clear()
            self._run_jobs()
            if self._stopping:
                break
            if self.held or not self.has_work():
                if self.paused:
                    self._expire_paused_waits()
                self._wakeup.wait(timeout=1.0)
                continue
            try:
                if not self.running and self.config.prefill_wait_ms > 0:
                    self._gather_arrivals()
                    if self._stopping or self.held:
                        continue
                self._admit()
                if self.running:
                    self._decode()
            except Exception as exc:  # a bug outside the guarded steps: fail what is in flight, keep serving
                log.exception("scheduler iteration failed")
                self.stats.step_errors += 1
                self._fail_everything(f"engine error: {type(exc).__name__}: {exc}")
        self._run_jobs()

    def _gather_arrivals(self) -> None:
        """The engine is idle and requests came in: let the rest of the burst arrive first.

        Waits until ``prefill_gap_ms`` pass with no new request, ``prefill_wait_ms`` pass in all,
        or a full batch is waiting, so that one forward prefills the burst (see ``EngineConfig``).
        Control jobs that come meanwhile run here as usual (nothing is running).
        """
        deadline = time.monotonic() + self.config.prefill_wait_ms / 1000
        gap = self.config.prefill_gap_ms / 1000
        while len(self.waiting) < self.config.max_running_requests and not self._stopping and not self.held:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._wakeup.clear()
            self._run_jobs()  # what arrived between the last check and clear()
            if not self._wakeup.wait(min(gap, remaining)):
                self._run_jobs()
                return
            self._run_jobs()
            self.stats.gathered_waits += 1

    def _fail_everything(self, message: str) -> None:
        for seq in [*self.running, *self.waiting]:
            seq.abort(message)
            self._deliver(seq)
        self.running.clear()
        self.waiting.clear()
        self.runner.cache.release()
        if self.runner.prefix is not None:  # what the failed step left in the slots is in doubt
            self.runner.prefix.drop_memory()

    def _run_jobs(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            job()

    def _reserved(self, seq: Sequence) -> int:
        return len(seq.prompt_ids) + seq.max_new_tokens

    def _admit(self) -> None:
        budget = self.config.prefill_tokens_per_step
        admitted = 0
        fresh: list[Sequence] = []  # new requests, prefilled together in one forward
        while self.waiting and len(self.running) + len(fresh) < self.config.max_running_requests:
            seq = self.waiting[0]
            cached = self.runner.prefix.usable(seq) if self.runner.prefix is not None else 0
            need = len(seq.all_ids) - seq.kv_len - cached
            if admitted and need > budget:
                break
            if (self.running or fresh) and not self._fits(seq, fresh):
                break
            self.waiting.popleft()
            admitted += 1
            budget -= need
            if seq.max_new_tokens <= len(seq.output_ids):
                seq.finish = FinishReason(type="length", length=len(seq.output_ids))
                self._deliver(seq)
                continue
            if seq.kv_len == 0 and not cached:
                fresh.append(seq)
            else:  # part of it cached (prefix cache, or an in-place pause): prefilled on its own
                self._prefill([seq])
        # A batched prefill pads to the longest prompt, which moves a row's bits under the deterministic
        # engine's kernels; true_on_policy's are invariant to padding (a row's keys are its own range).
        if fresh and self.config.enable_deterministic_inference:
            for seq in fresh:
                self._prefill([seq])
        elif fresh:
            self._prefill(fresh)

    def _fits(self, seq: Sequence, admitting: list[Sequence]) -> bool:
        others = [*self.running, *admitting]
        worst = max([self._reserved(s) for s in others] + [self._reserved(seq)])
        return (len(others) + 1) * worst <= self.max_kv_tokens

    def _prefill(self, seqs: list[Sequence]) -> None:
        first_slot = len(self.running)
        self.running.extend(seqs)
        started = time.perf_counter()
        prefix = self.runner.prefix
        restored = 0
        if prefix is not None and len(seqs) == 1 and seqs[0].kv_len == 0:
            self.runner.reserve(first_slot + 1, len(seqs[0].all_ids))
            restored = prefix.restore(seqs[0], first_slot)
        fed = sum(len(s.all_ids) - s.kv_len for s in seqs)
        try:
            if len(seqs) == 1:
                logits = self.runner.prefill(seqs[0], first_slot)
            else:
                logits = self.runner.prefill_batch(seqs, first_slot)
            prefilled = seqs
        except Exception as exc:
            log.exception("prefill of %d request(s) failed", len(seqs))
            self.stats.step_errors += 1
            prefilled, logits = self._prefill_one_by_one(seqs, first_slot, exc)
        if prefilled:
            if prefix is not None:  # before sampling: the KV holds exactly the fed tokens now
                for offset, seq in enumerate(seqs):
                    if not seq.finished:
                        prefix.store(seq, first_slot + offset)
            self._append_sampled(prefilled, logits)
            self.stats.prefill_requests += len(prefilled)
            self.stats.prefill_forwards += 1
            self.stats.prefill_tokens += fed
            self.stats.cached_prefill_tokens += restored
        self.stats.prefill_seconds += time.perf_counter() - started
        self._retire_finished()

    def _prefill_one_by_one(self, seqs: list[Sequence], first_slot: int, error: Exception) -> tuple[list[Sequence], Any]:
        """After a failed prefill of several requests: each alone, so only the one that fails is lost."""
        import torch

        if len(seqs) == 1:
            seqs[0].abort(f"engine error while prefilling this request: {type(error).__name__}: {error}")
            return [], None
        done, rows = [], []
        for offset, seq in enumerate(seqs):
            try:
                rows.append(self.runner.prefill(seq, first_slot + offset))
                done.append(seq)
            except Exception as exc:
                log.exception("prefill of request %s failed on its own", seq.rid)
                seq.abort(f"engine error while prefilling this request: {type(exc).__name__}: {exc}")
        return done, (torch.cat(rows) if rows else None)

    def _decode(self) -> None:
        seqs = list(self.running)
        started = time.perf_counter()
        try:
            logits = self.runner.decode(seqs)
        except Exception as exc:  # the forward of the whole batch: every request's state is in doubt
            log.exception("decode step of %d requests failed", len(seqs))
            self.stats.step_errors += 1
            for seq in seqs:
                seq.abort(f"engine error in a decode step: {type(exc).__name__}: {exc}")
            self._retire_finished()
            return
        self._append_sampled(seqs, logits)
        self.stats.decode_seconds += time.perf_counter() - started
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(seqs)
        self.stats.max_decode_batch = max(self.stats.max_decode_batch, len(seqs))
        self._retire_finished()

    def _append_sampled(self, seqs: list[Sequence], logits: Any) -> None:
        """Sample the next token of every request from its row of ``logits`` ``[B, V]``; a request
        whose sampling fails is aborted alone, the others go on."""
        for seq, outcome in zip(seqs, self._sample_rows(seqs, logits), strict=True):
            if isinstance(outcome, Exception):
                seq.abort(f"engine error while sampling this request: {type(outcome).__name__}: {outcome}")
                continue
            try:
                seq.append(outcome[0], outcome[1], self.stop_checker)
            except Exception as exc:
                log.exception("stop check of request %s failed", seq.rid)
                seq.abort(f"engine error after sampling: {type(exc).__name__}: {exc}")

    def _sample_rows(self, seqs: list[Sequence], logits: Any) -> list[tuple[int, float] | Exception]:
        """One batched draw; if it fails, one draw per row, so the failure stays with its request."""
        try:
            tokens, logprobs = sample(logits, [s.sampling for s in seqs], [s.output_ids for s in seqs],
                                      [s.prompt_ids for s in seqs], self.generator)
            return list(zip(tokens.tolist(), logprobs.tolist(), strict=True))
        except Exception as exc:
            log.exception("sampling a batch of %d requests failed", len(seqs))
            self.stats.step_errors += 1
            if len(seqs) == 1:
                return [exc]
        outcomes: list[tuple[int, float] | Exception] = []
        for row, seq in enumerate(seqs):
            try:
                token, logprob = sample(logits[row : row + 1], [seq.sampling], [seq.output_ids], [seq.prompt_ids],
                                        self.generator)
                outcomes.append((int(token[0]), float(logprob[0])))
            except Exception as exc:
                outcomes.append(exc)
        return outcomes

    def _retire_finished(self) -> None:
        """Deliver finished running requests; keep the rest dense in slots 0 .. B-1."""
        for index in range(len(self.running) - 1, -1, -1):
            seq = self.running[index]
            if not seq.finished:
                continue
            if self.runner.prefix is not None:  # before another request moves into its slot
                assert seq.finish is not None
                self.runner.prefix.leave(seq, index, keep=seq.finish.type != "abort")
            last = len(self.running) - 1
            if index != last:
                moved = self.running[last]
                self.runner.cache.move(last, index, moved.kv_len)
                self.running[index] = moved
            self.running.pop()
            self._deliver(seq)

    def _deliver(self, seq: Sequence) -> None:
        assert seq.finish is not None  # only finished sequences are delivered
        seq.weight_version = self.weight_version
        self.stats.finished[seq.finish.type] += 1
        try:
            seq.on_finish(seq)
        except Exception:
            log.exception("delivering the result of request %s failed", seq.rid)


def prefix_cache_tokens(config: EngineConfig, max_kv_tokens: int) -> int:
    """Tokens the prefix cache may keep (0: no prefix cache); see ``EngineSection.radix_cache_tokens``."""
    if config.disable_radix_cache is not False:  # opt-in: unset means off (EngineSection.disable_radix_cache)
        return 0
    return config.radix_cache_tokens or max(max_kv_tokens // 2, 1)
