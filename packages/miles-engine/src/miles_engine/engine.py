"""``Engine``: the in-process API of the embedded engine.

    engine = Engine("~/.cache/miles/models/smollm2-135m-instruct", max_running_requests=32)
    response = await engine.generate(GenerateRequest(text="Hello", sampling_params={"max_new_tokens": 8}))
    engine.shutdown()

Requests and responses are the wire types of :mod:`miles_contracts.wire.engine` (SGLang's native
API), so the HTTP server is a thin layer over this class. ``generate`` may be awaited from any
number of tasks at once: the scheduler thread batches them. Invalid requests raise
:class:`BadRequestError` before anything is queued.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

from miles_contracts.wire.engine import (
    GenerateRequest,
    GenerateResponse,
    MetaInfo,
    ModelInfo,
    SamplingParams,
    encode_routed_experts,
)
from miles_models.long_texts import LONG_TEXT_CHARS, TokenizerThread, chars_per_token_bound, min_tokens
from pydantic import ValidationError

from miles_engine.config import EngineConfig, engine_config
from miles_engine.loading import LoadedModel, load_model
from miles_engine.sampling import RowSampling, request_seed
from miles_engine.scheduler import PauseMode, Scheduler
from miles_engine.sequence import Sequence
from miles_engine.weight_updates import WeightUpdates

_DEFAULT_CPU_KV_GB = 2.0
_CUDA_KV_FRACTION = 0.4


class BadRequestError(ValueError):
    """The request cannot be served as given; the message says what to change."""


class Engine:
    def __init__(self, model_path: str | Path, *, background: bool = True, **options: Any) -> None:
        """Load the model and start scheduling (on a background thread; with ``background=False``
        the caller runs ``engine.scheduler.run()`` on a thread of its choice, ideally the main one).

        ``options`` are keys of :class:`~miles_engine.config.EngineConfig` (the ``engine`` config
        section's, plus ``device``, ``dtype`` and ``enable_deterministic_inference``); a bad one is
        a ``ValueError`` listing every problem."""
        self.config = engine_config(model_path, **options)
        self.loaded: LoadedModel = load_model(self.config)
        self.max_kv_tokens = self._kv_budget()
        self.scheduler = Scheduler(self.loaded, self.config, self.max_kv_tokens)
        self.weights = WeightUpdates(self.scheduler, self.loaded,
                                     allowed_dirs=[self.config.model_path, *self.config.weight_dir],
                                     group_timeout=self.config.weight_group_timeout)
        self._inflight: dict[str, asyncio.Future[Sequence]] = {}
        self.chars_per_token = chars_per_token_bound(self.loaded.tokenizer)
        self._long_texts = TokenizerThread(self.loaded.tokenizer, add_special_tokens=True,
                                           name="miles-engine-tokenize")
        self.started_at = time.time()
        if background:
            self.scheduler.start()

    @classmethod
    def from_config(cls, config: EngineConfig, *, background: bool = True) -> Engine:
        return cls(config.model_path, background=background, **config.model_dump(exclude={"model_path"}))

    # ------------------------------------------------------------------ generation

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        if self.scheduler.stopped:
            raise RuntimeError("the engine has been shut down")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Sequence] = loop.create_future()

        def on_finish(seq: Sequence) -> None:
            loop.call_soon_threadsafe(_resolve, done, seq)

        _check_request(request)  # before a long text is tokenized for a request that fails anyway
        text_ids = None if request.text is None else await self._text_ids(request.text)
        seq = self._sequence(request, on_finish, text_ids)
        self._inflight[seq.rid] = done
        try:
            self.scheduler.submit(seq)
            finished = await asyncio.shield(done)
        except asyncio.CancelledError:
            # The caller gave up (e.g. its HTTP client went away): free the batch slot.
            self.scheduler.call(lambda: self.scheduler.abort(seq.rid, "the client cancelled the request"))
            raise
        finally:
            self._inflight.pop(seq.rid, None)
        return self._response(finished)

    def _sequence(self, request: GenerateRequest, on_finish: Any, text_ids: list[int] | None = None) -> Sequence:
        loaded = self.loaded
        params = request.sampling_params
        if request.input_ids is not None:
            ids = list(request.input_ids)
            bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < loaded.vocab_size]
            if bad:
                raise BadRequestError(f"input_ids holds {len(bad)} token id(s) outside [0, {loaded.vocab_size}), "
                                      f"first at position {bad[0][0]}: {bad[0][1]}")
        else:
            assert text_ids is not None  # a GenerateRequest holds exactly one of text and input_ids
            ids = text_ids
            if not ids:
                raise BadRequestError("'text' tokenizes to no tokens; send a non-empty prompt")
        context = loaded.context_length
        if len(ids) >= context:
            raise BadRequestError(f"the prompt has {len(ids)} tokens but the context length is {context}; "
                                  f"shorten the prompt or start the engine with a larger --context-length")
        if request.logprob_start_len not in (-1,) and request.logprob_start_len < len(ids):
            raise BadRequestError("input-token logprobs (logprob_start_len >= 0) are not supported by the embedded "
                                  "engine; leave logprob_start_len at -1")
        if request.return_routed_experts and self.scheduler.runner.routing is None:
            raise BadRequestError("return_routed_experts needs a mixture-of-experts model; this model has no routers")
        routed_start = request.routed_experts_start_len or 0
        if routed_start > len(ids):
            raise BadRequestError(f"routed_experts_start_len ({routed_start}) must be at most the "
                                  f"prompt's length ({len(ids)} tokens)")
        rid = request.rid or uuid.uuid4().hex
        if rid in self._inflight:
            raise BadRequestError(f"a request with rid {rid!r} is already running; rids must be unique")
        max_new = min(params.max_new_tokens, context - len(ids))
        if len(ids) + max_new > self.max_kv_tokens:
            raise BadRequestError(f"prompt + max_new_tokens = {len(ids) + max_new} tokens exceeds the KV cache "
                                  f"({self.max_kv_tokens} tokens); lower max_new_tokens or give the engine more "
                                  f"--max-kv-tokens")
        explicit_stops = frozenset(params.stop_token_ids or ())
        bad_stops = [t for t in explicit_stops if not 0 <= t < loaded.vocab_size]
        if bad_stops:
            raise BadRequestError(f"stop_token_ids {sorted(bad_stops)} are outside [0, {loaded.vocab_size})")
        # As SGLang: ignore_eos turns off every token-based stop, stop_token_ids included
        stop_ids = frozenset() if params.ignore_eos else explicit_stops | loaded.eos_token_ids
        return Sequence(
            rid=rid, prompt_ids=ids, params=params, sampling=self._row_sampling(request, stop_ids, len(ids)),
            max_new_tokens=max_new, stop_ids=stop_ids, return_logprob=request.return_logprob,
            return_routed_experts=request.return_routed_experts, routed_start=routed_start,
            on_finish=on_finish,
        )

    async def _text_ids(self, text: str) -> list[int]:
        """The prompt ids of ``text``. One that cannot fit the context is refused before it is
        tokenized; a long one is tokenized on a worker thread, never under the codec's lock, which
        the event loop takes to decode every answer (see :mod:`miles_models.long_texts`)."""
        context = self.loaded.context_length
        fewest = min_tokens(len(text), self.chars_per_token)
        if fewest >= context:
            raise BadRequestError(f"'text' has {len(text)} characters, at least {fewest} tokens (no token of this "
                                  f"model stands for more than {self.chars_per_token} characters), but the context "
                                  f"length is {context}; shorten the prompt or start the engine with a larger "
                                  f"--context-length")
        if len(text) <= LONG_TEXT_CHARS:
            return self.scheduler.codec.encode(text)
        return await self._long_texts.encode(text)

    def _row_sampling(self, request: GenerateRequest, stop_ids: frozenset[int], prompt_len: int) -> RowSampling:
        import torch

        params = request.sampling_params
        generator = None
        if params.sampling_seed is not None:
            generator = torch.Generator(device=self.loaded.device).manual_seed(
                request_seed(params.sampling_seed, prompt_len))
        return RowSampling(
            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            min_new_tokens=params.min_new_tokens, banned_until_min=tuple(sorted(stop_ids)),
            frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
            repetition_penalty=params.repetition_penalty, generator=generator,
        )

    def _response(self, seq: Sequence) -> GenerateResponse:
        meta = MetaInfo(
            id=seq.rid, finish_reason=seq.finish, prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids), cached_tokens=seq.cached_tokens, weight_version=seq.weight_version,
            e2e_latency=time.perf_counter() - seq.created,
        )
        if seq.return_logprob:
            meta.output_token_logprobs = [[lp, tok, None] for lp, tok in zip(seq.logprobs, seq.output_ids, strict=True)]
        if seq.return_routed_experts:
            meta.routed_experts = self._routed(seq)
        return GenerateResponse(text=self.scheduler.stop_checker.text(seq), output_ids=seq.output_ids, meta_info=meta)

    def _routed(self, seq: Sequence) -> str:
        import torch

        routing = self.scheduler.runner.routing
        assert routing is not None  # requests for routed experts on a model without routers are refused
        rows = max(len(seq.prompt_ids) + len(seq.output_ids) - 1, 0)
        if seq.routed:
            table = torch.cat(seq.routed)[seq.routed_start : rows]  # rows [start, positions fed - 1)
        else:
            table = torch.zeros(0, routing.num_layers, routing.top_k, dtype=torch.int32)
        return encode_routed_experts(table.contiguous().numpy().astype("<i4").tobytes())

    # ------------------------------------------------------------------ control

    async def abort(self, rid: str | None = None) -> int:
        """Abort ``rid`` (every request when None); aborted requests answer with what they have."""
        message = "aborted by /abort_request" if rid else "aborted by /abort_request (abort_all)"
        return await self._call(lambda: self.scheduler.abort(rid, message))

    async def pause(self, mode: PauseMode = "abort") -> None:
        await self._call(lambda: self.scheduler.pause(mode))

    async def resume(self) -> None:
        await self._call(self.scheduler.resume)

    async def flush_cache(self) -> bool:
        """Drop the KV cache; False (nothing done) while requests are queued or running, as SGLang."""
        return await self._call(self.scheduler.flush_cache)

    async def release_memory(self, tags: list[str] | None) -> list[str]:
        """Give back GPU memory (``weights``, ``kv_cache``, ``cuda_graph``; all when None); idle engines only."""
        return await self._call(lambda: self.scheduler.memory.release(tags))

    async def resume_memory(self, tags: list[str] | None) -> list[str]:
        return await self._call(lambda: self.scheduler.memory.resume(tags))

    async def _call(self, fn: Any) -> Any:
        return await asyncio.wrap_future(self.scheduler.call(fn))

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    @property
    def paused(self) -> bool:
        return self.scheduler.paused

    def model_info(self) -> ModelInfo:
        loaded = self.loaded
        routing = self.scheduler.runner.routing
        # fields beyond ModelInfo's own (it allows extra ones), which type checkers cannot see as keywords
        extra: dict[str, Any] = dict(
            served_model_name=self.config.served_model_name or Path(self.config.model_path).name,
            model_type=loaded.model.config.model_type, architectures=list(loaded.model.config.architectures or []),
            vocab_size=loaded.vocab_size,
            context_length=loaded.context_length, device=str(loaded.device),
            dtype=str(loaded.dtype).removeprefix("torch."),
            num_moe_layers=routing.num_layers if routing else 0, moe_top_k=routing.top_k if routing else 0,
        )
        return ModelInfo(
            model_path=self.config.model_path, tokenizer_path=self.config.tokenizer_path or self.config.model_path,
            is_generation=True, weight_version=self.weight_version, **extra,
        )

    def server_info(self) -> dict[str, Any]:
        """Engine settings and batching statistics (``GET /get_server_info``)."""
        cache = self.scheduler.runner.cache
        prefix = self.scheduler.runner.prefix
        return {
            "engine": "miles-embedded", "tp_size": 1, "weight_version": self.weight_version,
            "paused": self.paused, "memory_released": sorted(self.scheduler.memory.released),
            "max_running_requests": self.config.max_running_requests,
            "context_length": self.loaded.context_length, "max_kv_tokens": self.max_kv_tokens,
            "kv_cache_bytes": cache.nbytes, "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting), "stats": self.scheduler.stats.as_dict(),
            "cuda_graphs": self._graph_info(),
            "radix_cache": prefix.info() if prefix is not None else {"enabled": False},
            "uptime_s": round(time.time() - self.started_at, 3),
        }

    def _graph_info(self) -> dict[str, Any]:
        graphs = self.scheduler.runner.graphs
        if graphs is None:
            return {"enabled": False}
        return {"enabled": True, "captured": graphs.captures, "live": len(graphs.graphs), "replays": graphs.replays,
                "batch_buckets": graphs.buckets}

    def shutdown(self) -> None:
        self.scheduler.stop()
        self.weights.close()

    def _kv_budget(self) -> int:
        import torch

        if self.config.max_kv_tokens:
            return self.config.max_kv_tokens
        loaded = self.loaded
        per_token = 2 * loaded.num_layers * loaded.num_kv_heads * loaded.head_dim * loaded.dtype.itemsize
        if self.config.kv_cache_gb:
            budget = self.config.kv_cache_gb * 2**30
        elif loaded.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(loaded.device)
            budget = free * _CUDA_KV_FRACTION
        else:
            budget = _DEFAULT_CPU_KV_GB * 2**30
        return max(int(budget // per_token), 2)


def _check_request(request: GenerateRequest) -> None:
    if request.stream:
        raise BadRequestError("streaming is not supported by the embedded engine; send \"stream\": false")
    _check_sampling(request.sampling_params)


def _check_sampling(params: SamplingParams) -> None:
    """The wire schema's bounds, again: in-process callers may build requests without validation
    (``model_construct`` / ``model_copy``), and a value outside them would fail inside a batched
    step, where it would cost every request of the batch."""
    try:
        SamplingParams.model_validate(dict(params))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'sampling_params'}: {e['msg']}" for e in exc.errors())
        raise BadRequestError(f"invalid sampling_params: {problems}") from None


def _resolve(future: asyncio.Future[Sequence], seq: Sequence) -> None:
    if not future.done():
        future.set_result(seq)
