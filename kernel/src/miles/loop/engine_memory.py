"""The engines hand their memory to the trainer while it trains (``resources.release_engine_memory``).

On a GPU that a trainer rank shares with an engine (``resources.colocate``), the engine's KV cache,
CUDA graphs and weights lie idle while the trainer trains. With the setting on, a ``sync`` step is::

    rollout                      engines serve
    release                      /pause_generation {mode: abort}, /flush_cache until the engine is
                                 idle, /release_memory_occupation {tags}
    train                        the ranks use that memory, and hand their cached blocks back after
    resume weights               /resume_memory_occupation {tags: [weights]}: a released engine
                                 refuses weight updates
    weight sync                  overwrites every weight (SGLang without --enable-weights-cpu-backup
                                 lost them on release; the embedded engine copied them to host memory)
    resume the rest              KV cache, CUDA graphs; then /continue_generation
    evaluate, checkpoint, the next rollout

``kv_cache`` releases the KV cache only; ``all`` the KV cache, the CUDA graphs and the weights. The
driver calls each engine at its own URL, all at once, with the engine client and the run's token:
the embedded engine and SGLang serve the same routes (:mod:`miles_contracts.wire.engine`).

Per engine, what it released is remembered with the start count of its process at that moment. An
engine the supervisor restarted since then is a fresh process that holds all of its memory: it is
not asked to resume (SGLang's scheduler process dies on a resume of a tag it never released), and
the weight sync gives it the trainer's weights as it does any restarted engine. An engine that
cannot be reached is taken for dead (the supervisor starts it again). An engine that answers with
an error refuses for a reason that would recur (it cannot be made idle, it lacks the route): the
run stops with what it said.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from miles.engine_client import EngineRequestError, EngineUnavailableError, HttpEngineClient
from miles.errors import MilesError

RELEASED_TAGS: dict[str, tuple[str, ...]] = {
    "none": (),
    "kv_cache": ("kv_cache",),
    "all": ("kv_cache", "cuda_graph", "weights"),
}
"""What each value of ``resources.release_engine_memory`` releases (the engines' memory tags)."""

WEIGHTS = ("weights",)

IDLE_TIMEOUT = 60.0
"""Seconds an engine may take to finish what a pause in mode ``abort`` ended (it stops each
request at its next step, not at once) before the release gives up."""


class EngineFleet(Protocol):
    """Where the engines are (:class:`miles.loop.services.Services` in a run)."""

    @property
    def engine_urls(self) -> dict[str, str]: ...

    def starts(self, name: str) -> int: ...


@dataclass(slots=True)
class _Released:
    start: int  # the engine's start count when it released
    tags: set[str]


class EngineMemory:
    """Releases and resumes the engines' memory; every method runs on the driver's event loop."""

    def __init__(self, setting: str, fleet: EngineFleet, *, idle_timeout: float = IDLE_TIMEOUT) -> None:
        self.setting = setting
        self.tags = RELEASED_TAGS[setting]
        self._fleet = fleet
        self._idle_timeout = idle_timeout
        self._released: dict[str, _Released] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.tags)

    @property
    def holding(self) -> set[str]:
        """Engines that have released memory and not taken all of it back."""
        return set(self._released)

    async def release(self) -> float:
        """Every engine, idle after a rollout, gives back :attr:`tags`; the seconds it took."""
        start = time.perf_counter()
        engines = self._fleet.engine_urls
        outcomes = await asyncio.gather(*(self._release(name, url) for name, url in engines.items()),
                                        return_exceptions=True)
        self._raise_refusals("release", list(engines), outcomes)
        return time.perf_counter() - start

    async def resume(self, tags: Collection[str] | None = None) -> float:
        """Every engine that released ``tags`` (None: whatever it still holds released) takes them
        back; one left holding nothing released continues generating. The seconds it took."""
        start = time.perf_counter()
        names = list(self._released)
        urls = self._fleet.engine_urls
        outcomes = await asyncio.gather(*(self._resume(name, urls.get(name), tags) for name in names),
                                        return_exceptions=True)
        self._raise_refusals("resume", names, outcomes)
        return time.perf_counter() - start

    # ------------------------------------------------------------------ one engine

    async def _release(self, name: str, url: str) -> None:
        async with HttpEngineClient(url) as client:
            try:
                await client.control("/pause_generation", {"mode": "abort"})
                await self._until_idle(client)
                await client.control("/release_memory_occupation", {"tags": list(self.tags)})
            except EngineUnavailableError:
                return  # it died: the supervisor starts it again, with all of its memory
        # read after the answer: had it restarted in between, the resume goes to the fresh process,
        # which a resume cannot harm more than a restart already did
        self._released[name] = _Released(self._fleet.starts(name), set(self.tags))

    async def _until_idle(self, client: HttpEngineClient) -> None:
        """Until ``/flush_cache`` succeeds, which both engines allow only with nothing queued or
        running: SGLang's scheduler asserts that it is idle when asked to release, and its process
        dies when it is not."""
        deadline = time.monotonic() + self._idle_timeout
        while True:
            try:
                await client.control("/flush_cache")
                return
            except EngineRequestError as exc:
                if exc.status_code != 400 or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.05)

    async def _resume(self, name: str, url: str | None, tags: Collection[str] | None) -> None:
        record = self._released[name]
        if url is None or self._fleet.starts(name) != record.start:
            del self._released[name]  # a fresh process: nothing of it is released
            return
        wanted = sorted(record.tags if tags is None else record.tags & set(tags))
        if not wanted:
            return
        async with HttpEngineClient(url) as client:
            try:
                await client.control("/resume_memory_occupation", {"tags": wanted})
                record.tags -= set(wanted)
                if not record.tags:
                    await client.control("/continue_generation")
            except EngineUnavailableError:
                record.tags.clear()  # it died: it comes back whole
        if not record.tags:
            del self._released[name]

    def _raise_refusals(self, action: str, names: Sequence[str], outcomes: Sequence[object]) -> None:
        refused = [f"{name}: {outcome}" for name, outcome in zip(names, outcomes, strict=True)
                   if isinstance(outcome, BaseException)]
        if not refused:
            return
        first = next(o for o in outcomes if isinstance(o, BaseException))
        if not isinstance(first, Exception):
            raise first  # a cancellation, not an engine's answer
        raise MilesError(f"could not {action} the engines' memory (resources.release_engine_memory: {self.setting}): "
                         + "; ".join(refused)) from first


__all__ = ["RELEASED_TAGS", "WEIGHTS", "EngineFleet", "EngineMemory"]
