"""The life of one weight sync, shared by every transport in this package.

::

    stage buckets (disk: write safetensors)           engines still generate
    pause_generation(mode)                            -- engines stop here --
    flush_cache (mode abort only)                     KV computed with old weights is void
    [check mode, first sync of an engine: embedded engine: fill_weights_noise, remember its
     checksums; SGLang: weights_checker snapshot, then reset_tensors]
    deliver buckets (disk: one load; shared memory: one call per bucket; broadcast: one collective per bucket, or per tensor)
    [check mode: embedded engine: every sent tensor's checksum equals the trainer's, nothing left
     as noise; SGLang (first sync): weights_checker compare]
    update_weight_version(version)                    only once every bucket landed
    continue_generation                               -- engines resume --

Buckets are sent with ``flush_cache: false`` and without ``weight_version``; the cache is flushed
once after the last one. Generation is paused throughout, so nothing reads a half-updated model,
and the version is set only after every bucket landed: no generated token carries a version whose
weights its engine does not fully hold. When a step fails, the engines stay paused (see
:class:`~miles_weights.errors.WeightSyncError`).

Nothing runs while the engines are paused, so the flush comes right after the pause. SGLang
flushes only a fully idle engine (it answers 400 otherwise), so the flush is sent after a pause in
mode ``abort`` only, and a 400 is not a failure: with partial rollout (``run.mode: fully_async``)
a generation the pause aborted is sent again at once and waits in the engine's queue. That request
holds no KV; the embedded engine keeps none across requests, so nothing computed with old weights
survives there. SGLang's radix cache would keep its old prefix entries when it declines: runs with
partial rollout on SGLang set ``sglang.disable_radix_cache: true`` (docs/design/async.md). A
declined flush is logged once per engine. The pause modes: ``retract`` keeps the paused requests queued (their KV was dropped
when they were retracted; they are prefilled again with the new weights) and ``in_place`` keeps
their KV on purpose. ``update_weight_version`` says ``abort_all_requests: false``: SGLang's default
would abort the requests a ``retract`` or ``in_place`` pause holds.

SGLang's check mode proves a sync by comparison with a snapshot taken before the noise, so it
holds only when the engine was serving exactly the trainer's weights then: the first sync of a
run, from the checkpoint both loaded (what ``weights.check`` is for). Later syncs of an SGLang
engine are not checked.
"""

from __future__ import annotations

import itertools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from miles.sections import WeightsSection
from miles_contracts.weights import TransferReport, WeightBucket, bucketize
from pydantic import BaseModel, ConfigDict, ValidationError

from miles_weights.checksums import TensorTally, compare_checksums
from miles_weights.engine_info import EngineInfo
from miles_weights.engines import EngineCalls, normalize_targets
from miles_weights.errors import WeightCheckError, WeightSyncError
from miles_weights.settings import PauseMode, WeightTransportSection, declared, same_types

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch
    from miles.config import MilesConfig

_MB = 1 << 20


_SOURCES: dict[str, tuple[str, type[BaseModel]]] = {
    "bucket_mb": ("weights", WeightsSection),
    "check": ("weights", WeightsSection),
    "pause_mode": ("weight_transport", WeightTransportSection),
    "http_timeout": ("weight_transport", WeightTransportSection),
    "check_seed": ("weight_transport", WeightTransportSection),
}
"""Where each option every transport shares is declared: ``(config section, its model)``."""


def _declared(name: str) -> Any:
    section = _SOURCES[name][1]
    return declared(section, name)


class TransportOptions(BaseModel):
    """What every transport of this package is tuned by: the fields of ``weights`` and
    ``weight_transport`` that apply to all of them, with the defaults, bounds and descriptions
    those sections declare (they are copied from there, not written again).

    :ivar bucket_mb: bytes per bucket, in MiB; a larger tensor travels alone.
    :ivar check: fill engine weights with noise before their first sync and verify every sync.
    :ivar pause_mode: ``abort`` | ``retract`` | ``in_place``, sent to ``/pause_generation``.
    :ivar http_timeout: seconds one engine call may take.
    :ivar check_seed: seed of the noise fill.
    :raises ValueError: a value its section would refuse, named by its config key.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    bucket_mb: int = _declared("bucket_mb")
    check: bool = _declared("check")
    pause_mode: PauseMode = _declared("pause_mode")
    http_timeout: float = _declared("http_timeout")
    check_seed: int = _declared("check_seed")

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ValueError("invalid weight transport options: " + "; ".join(
                f"{_key(error['loc'])}: {error['msg']} (got {error.get('input')!r})" for error in exc.errors()
            )) from None

    @property
    def bucket_bytes(self) -> int:
        return self.bucket_mb * _MB

    @classmethod
    def from_config(cls, config: MilesConfig) -> TransportOptions:
        """The options of the run of ``config``: its ``weights`` and ``weight_transport`` sections."""
        sections = {"weights": config.weights,
                    "weight_transport": config.section("weight_transport", WeightTransportSection)}
        return cls(**{name: getattr(sections[key], name) for name, (key, _) in _SOURCES.items()})


def _key(loc: tuple[Any, ...]) -> str:
    """``weights.bucket_mb`` for the location of a validation error (the config key to fix)."""
    name = str(loc[0]) if loc else "?"
    return f"{_SOURCES[name][0]}.{name}" if name in _SOURCES else name


if set(_SOURCES) != set(TransportOptions.model_fields):  # a field added on one side only
    raise TypeError("TransportOptions' fields and their _SOURCES differ")
same_types(TransportOptions, {name: model for name, (_, model) in _SOURCES.items()})


def describe_bucket(index: int, bucket: WeightBucket) -> str:
    """``bucket 3 (12 tensors, 40.0 MB: first.name .. last.name)`` for error messages."""
    names = bucket.names
    span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
    return f"bucket {index} ({len(names)} tensors, {bucket.nbytes / 1e6:.1f} MB: {span})"


class BucketedTransport(ABC):
    """A :class:`miles_contracts.WeightTransport` that sends buckets between pause and continue.

    Subclasses say how buckets reach the engines (:meth:`_deliver`) and, optionally, what to
    prepare before the engines pause (:meth:`_staged`).
    """

    name: str = "?"

    def __init__(self, options: TransportOptions | None = None) -> None:
        self.options = options or TransportOptions()
        self._calls = EngineCalls(timeout=self.options.http_timeout)
        self._noise: dict[str, dict[str, str]] = {}  # engine -> its checksums right after the noise fill
        self._snapshotted: set[str] = set()  # SGLang engines whose first sync check mode is proving now
        self._engines: dict[str, EngineInfo] = {}
        self._closed = False
        self._declined_flush: set[str] = set()

    # ------------------------------------------------------------------ the protocol

    def push(self, tensors: Iterable[tuple[str, torch.Tensor]], *, targets: Sequence[str] | str,
             version: int) -> TransferReport:
        """Deliver ``tensors`` (HF names) to every engine in ``targets``, then set their
        ``weight_version`` to ``version``. Returns what moved and how long it took; raises
        :class:`~miles_weights.errors.WeightSyncError` naming the engine and step that failed."""
        if self._closed:
            raise RuntimeError(f"the {self.name} weight transport was closed; create a new one")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        urls = normalize_targets(targets)
        self._check_targets(urls)
        tally = TensorTally(_non_empty(tensors), checksums=self.options.check)
        buckets = bucketize(tally, self.options.bucket_bytes)
        start = time.perf_counter()
        with self._staged(buckets, version) as staged:
            paused = time.perf_counter()
            self._calls.post_all(urls, "/pause_generation", {"mode": self.options.pause_mode},
                                 step=f"version {version}: pause generation")
            if self.options.pause_mode == "abort":
                self._note_declined_flush(self._calls.flush_all(urls, step=f"version {version}: flush cache"))
            if self.options.check:
                self._fill_noise([url for url in urls if url not in self._noise], version)
            num_buckets = self._deliver(staged, urls, version)
            checked = self._verify(urls, tally, version) if self.options.check else ()
            self._calls.post_all(urls, "/update_weight_version", {"new_version": str(version), "abort_all_requests": False},
                                 step=f"version {version}: update weight version")
            self._calls.post_all(urls, "/continue_generation", {}, step=f"version {version}: continue generation")
            resumed = time.perf_counter()
        end = time.perf_counter()  # after the staged files are cleaned up
        return TransferReport(version=version, num_tensors=tally.count, num_bytes=tally.nbytes, seconds=end - start,
                              num_buckets=num_buckets, paused_seconds=resumed - paused, checked_engines=checked)

    def _note_declined_flush(self, urls: list[str]) -> None:
        for url in urls:
            if url not in self._declined_flush:
                self._declined_flush.add(url)
                log.warning("engine %s declined /flush_cache: requests were queued during the pause (partial "
                            "rollout sends aborted generations again at once); they hold no KV", url)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._calls.close()

    def __enter__(self) -> BucketedTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ what subclasses decide

    def engine_info(self, urls: list[str], version: int | None = None) -> dict[str, EngineInfo]:
        """What each engine is (:mod:`miles_weights.engine_info`), asked once per engine."""
        step = "read the server info" if version is None else f"version {version}: read the server info"
        for url in urls:
            if url not in self._engines:
                answer = self._calls.get_optional(url, "/server_info", step=step)
                self._engines[url] = EngineInfo.from_server_info(answer or {})
        return {url: self._engines[url] for url in urls}

    def forget_engine(self, url: str) -> None:
        """Ask ``url`` again next time (it was restarted, possibly as something else)."""
        self._engines.pop(url, None)

    def _check_targets(self, urls: list[str]) -> None:
        """Reject targets this transport cannot reach (before anything is paused); all are fine by default."""
        return None

    def _staged(self, buckets: Iterator[WeightBucket], version: int) -> AbstractContextManager[Any]:
        """Prepare buckets while engines still generate; the default streams them lazily."""
        return nullcontext(buckets)

    @abstractmethod
    def _deliver(self, staged: Any, urls: list[str], version: int) -> int:
        """Move every bucket into every engine (generation is paused); return the bucket count."""

    # ------------------------------------------------------------------ check mode

    def _fill_noise(self, urls: list[str], version: int) -> None:
        if not urls:
            return
        engines = self.engine_info(urls, version)
        ours = [url for url in urls if engines[url].miles_formats]
        sglang = [url for url in urls if not engines[url].miles_formats]
        if ours:
            self._calls.post_all(ours, "/fill_weights_noise", {"seed": self.options.check_seed},
                                 step=f"version {version}: check mode, fill weights with noise")
            answers = self._calls.get_all(ours, "/weights_checksum",
                                          step=f"version {version}: check mode, checksums after noise")
            for url, answer in answers.items():
                self._noise[url] = dict(answer.get("checksums") or {})
        for action in ("snapshot", "reset_tensors"):
            self._calls.post_all(sglang, "/weights_checker", {"action": action},
                                 step=f"version {version}: check mode, weights_checker {action}")
        for url in sglang:
            self._noise[url] = {}
            self._snapshotted.add(url)

    def _verify(self, urls: list[str], tally: TensorTally, version: int) -> tuple[str, ...]:
        """Compare what each engine holds with what was sent; the engines proven bit-exact (an
        SGLang engine only on its first sync: later ones have no snapshot to compare with)."""
        engines = self.engine_info(urls, version)
        mismatches: dict[str, list[str]] = {}
        lines = []
        snapshotted = [url for url in urls if url in self._snapshotted]
        self._snapshotted.difference_update(snapshotted)
        compared = self._calls.submit(snapshotted, "POST", "/weights_checker", {"action": "compare"},
                                      step=f"version {version}: check mode, weights_checker compare")
        for url, future in compared.items():
            try:
                future.result()
            except WeightSyncError as exc:
                mismatches[url] = []
                lines.append(f"  - engine {url}: {exc}")
        ours = [url for url in urls if engines[url].miles_formats]
        answers = self._calls.get_all(ours, "/weights_checksum", step=f"version {version}: check mode, checksums after sync")
        for url, answer in answers.items():
            diff = compare_checksums(tally.checksums, answer.get("checksums") or {}, self._noise.get(url),
                                     not_floating=tally.not_floating)
            if not diff.ok:
                mismatches[url] = diff.names
                lines.append(f"  - engine {url}: {diff.describe()}")
        if mismatches:
            raise WeightCheckError(
                f"check mode: the {self.name} sync of version {version} is not bit-exact on {len(mismatches)} "
                f"engine(s) (engines stay paused):\n" + "\n".join(lines)
                + "\n(a trainer dtype other than the engine's also breaks bit-exactness: send the engine's dtype)",
                mismatches,
            )
        checked = (*snapshotted, *ours)
        for url in checked:
            log.info("check mode: the %s sync of version %d is bit-exact on engine %s (%d tensors)", self.name, version,
                     url, tally.count)
        return checked


def _non_empty(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    iterator = iter(tensors)
    first = next(iterator, None)
    if first is None:
        raise ValueError("push got no tensors: pass the model's (hf_name, tensor) pairs")
    return itertools.chain([first], iterator)
