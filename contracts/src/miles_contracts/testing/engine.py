"""Conformance suite for inference engines: the part of SGLang's HTTP API that Miles relies on.

One suite, two engines: CI runs it against the embedded engine, and ``scripts/h200/sglang_contract.sh``
against a live SGLang server, so the two answer the same requests the same way::

    from miles_contracts.testing.engine import ENGINE_CHECKS, EngineUnderTest, check_engine

    engine = EngineUnderTest("http://127.0.0.1:30000", token=os.environ.get("MILES_AUTH_TOKEN"),
                             model_path="/models/smollm2")   # the folder the engine loaded
    check_engine(engine)                       # every check; one AssertionError lists all failures
    ENGINE_CHECKS["pause_retract"](engine)     # one check (pytest: parametrize over ENGINE_CHECKS)

What is checked, each against a running server and nothing else (standard library HTTP only):

* ``health``, ``model_info``: ``/health`` and ``/health_generate`` answer 200; ``/model_info`` names
  the model and its ``weight_version``; ``/server_info`` gives ``tp_size``.
* ``generate``: token ids in, token ids, per-token log-probs and SGLang's ``meta_info`` out;
  ``greedy_repeatable``; ``stop_token_ids`` stop after the matched token; a malformed request is a
  4xx (``bad_request``).
* ``abort_rid``, ``abort_all``: an aborted request answers 200 with what it generated and finish
  reason ``abort``; the others are untouched.
* ``pause_abort``, ``pause_retract``, ``pause_in_place``: SGLang's three pause modes, what each does
  to in-flight requests, that new requests wait until ``/continue_generation``, and that
  ``/flush_cache`` succeeds only on an idle engine.
* ``update_weight_version``, ``update_weights_from_disk``, ``weights_checker`` (snapshot, random
  reset, a failing then passing compare after a reload from disk), ``memory_release``, ``auth``.

Tensor and broadcast updates need a trainer process on the same devices: the weight transports'
suite (:mod:`miles_contracts.testing.transport`) and the H200 scripts cover them. A check that needs
``model_path`` (or a token) raises :class:`EngineCheckSkipped` without it. Every check leaves the
engine serving, unpaused, at its original ``weight_version``.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from miles_contracts.wire.engine import GenerateResponse, ModelInfo

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # engines are never behind HTTP_PROXY

class EngineCheckSkipped(Exception):
    """The check needs something this :class:`EngineUnderTest` does not give (model path, token)."""


@dataclass(frozen=True, slots=True)
class EngineUnderTest:
    """A running engine and what the suite may assume about it.

    :ivar base_url: e.g. ``http://127.0.0.1:30000``.
    :ivar token: the run token, sent as ``Authorization: Bearer``; ``None``: the engine wants none.
    :ivar model_path: the folder the engine loaded its weights from, as the engine's host sees it
        (reloading it must give the same bytes); ``None`` skips the weight checks.
    :ivar prompt_ids: a prompt of token ids valid for the model.
    :ivar long_tokens: ``max_new_tokens`` of a request that must still run a second after it started
        (it must fit the context with the prompt).
    :ivar settle_s: how long a request is given to reach the engine's batch before the suite acts.
    """

    base_url: str
    token: str | None = None
    model_path: str | None = None
    prompt_ids: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    long_tokens: int = 2000
    settle_s: float = 0.5
    timeout: float = 300.0

    # ------------------------------------------------------------------ HTTP

    def call(self, method: str, path: str, body: Any = None, *, auth: bool = True) -> tuple[int, bytes]:
        """One request; returns the status and the raw body (errors are answers too)."""
        headers = {"Content-Type": "application/json"}
        if auth and self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url.rstrip("/") + path, data=data, method=method, headers=headers)
        try:
            with _DIRECT.open(request, timeout=self.timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except urllib.error.URLError as exc:
            raise AssertionError(f"{method} {self.base_url}{path}: engine unreachable ({exc.reason})") from exc

    def ok(self, method: str, path: str, body: Any = None) -> Any:
        """A request that must answer 2xx; its JSON (``None`` for an empty or non-JSON body)."""
        status, raw = self.call(method, path, body)
        _expect(200 <= status < 300, f"{method} {path} answered HTTP {status}: {raw[:300]!r}")
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return None

    def generate(self, max_new_tokens: int, **extra: Any) -> dict[str, Any]:
        """Greedy, EOS ignored, from :attr:`prompt_ids`; ``extra`` is merged into the request."""
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True,
                  **extra.pop("sampling_params", {})}
        answer = self.ok("POST", "/generate", {"input_ids": list(self.prompt_ids), "sampling_params": params, **extra})
        _expect(isinstance(answer, dict), f"/generate answered no JSON object: {answer!r:.300}")
        generated: dict[str, Any] = answer
        return generated

    def weight_version(self) -> str:
        return str(self.ok("GET", "/model_info").get("weight_version"))

    def set_version(self, version: str) -> None:
        self.ok("POST", "/update_weight_version", {"new_version": version, "abort_all_requests": False})


Check = Callable[[EngineUnderTest], None]
ENGINE_CHECKS: dict[str, Check] = {}


def _check(fn: Check) -> Check:
    ENGINE_CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


def check_engine(engine: EngineUnderTest, only: list[str] | None = None) -> list[str]:
    """Run the checks (all, or ``only``); returns the names skipped, raises one ``AssertionError``
    naming every check that failed and why."""
    failures, skipped = [], []
    for name in only or list(ENGINE_CHECKS):
        try:
            ENGINE_CHECKS[name](engine)
        except EngineCheckSkipped:
            skipped.append(name)
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
    if failures:
        raise AssertionError(f"{len(failures)} engine check(s) failed:\n" + "\n".join(f"  - {f}" for f in failures))
    return skipped


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _finish(answer: dict[str, Any]) -> dict[str, Any]:
    return (answer.get("meta_info") or {}).get("finish_reason") or {}


@contextmanager
def _background(engine: EngineUnderTest, workers: int = 4) -> Iterator[ThreadPoolExecutor]:
    """Requests in flight while the check acts; the engine is left unpaused whatever happens."""
    pool = ThreadPoolExecutor(workers, thread_name_prefix="engine-check")
    try:
        yield pool
    finally:
        engine.call("POST", "/continue_generation", {})
        engine.call("POST", "/abort_request", {"abort_all": True})
        pool.shutdown(wait=True)


def _still_waiting(future: Future[Any], seconds: float) -> bool:
    time.sleep(seconds)
    return not future.done()


# ---------------------------------------------------------------------- serving


@_check
def check_health(engine: EngineUnderTest) -> None:
    for path, auth in (("/health", False), ("/health_generate", True)):  # a generation probe is not public
        status, raw = engine.call("GET", path, auth=auth)
        _expect(status == 200, f"GET {path} answered HTTP {status}: {raw[:200]!r}")


@_check
def check_model_info(engine: EngineUnderTest) -> None:
    info = engine.ok("GET", "/model_info")
    parsed = ModelInfo.model_validate(info)
    _expect(bool(parsed.model_path), f"/model_info has no model_path: {info!r:.300}")
    _expect(parsed.weight_version is not None, f"/model_info has no weight_version: {info!r:.300}")
    server = engine.ok("GET", "/server_info")
    _expect(isinstance(server, dict) and isinstance(server.get("tp_size"), int) and server["tp_size"] >= 1,
            f"/server_info must give an int tp_size (weight syncs address each rank): {str(server)[:300]}")


@_check
def check_generate(engine: EngineUnderTest) -> None:
    n = 6
    answer = engine.generate(n, return_logprob=True, rid=f"contract-{uuid.uuid4().hex}")
    parsed = GenerateResponse.model_validate(answer)
    meta = parsed.meta_info
    _expect(len(parsed.output_ids) == n == meta.completion_tokens,
            f"asked {n} tokens with EOS ignored, got output_ids {parsed.output_ids} and completion_tokens "
            f"{meta.completion_tokens}")
    _expect(meta.prompt_tokens == len(engine.prompt_ids), f"prompt_tokens {meta.prompt_tokens}, sent {len(engine.prompt_ids)}")
    reason = meta.finish_reason
    _expect(reason is not None and reason.type == "length" and reason.length == n,
            f"finish_reason must be {{'type': 'length', 'length': {n}}}, got {reason}")
    entries = meta.output_token_logprobs or []
    _expect(len(entries) == n, f"{len(entries)} output_token_logprobs for {n} tokens")
    for (logprob, token, *_), expected in zip(entries, parsed.output_ids, strict=True):
        _expect(isinstance(token, int) and token == expected, f"output_token_logprobs names token {token}, output has {expected}")
        _expect(math.isfinite(float(logprob)) and float(logprob) <= 1e-6, f"log-prob {logprob} is not a finite value <= 0")
    _expect(meta.weight_version is not None, "meta_info has no weight_version")


@_check
def check_greedy_repeatable(engine: EngineUnderTest) -> None:
    first, second = engine.generate(12)["output_ids"], engine.generate(12)["output_ids"]
    _expect(first == second, f"the same greedy request gave {first}, then {second}")


@_check
def check_stop_token_ids(engine: EngineUnderTest) -> None:
    natural = {"ignore_eos": False}
    free = engine.generate(8, sampling_params=natural)["output_ids"]  # may end early at EOS: then so does the next
    stop = free[min(3, len(free) - 1)]
    cut = free.index(stop)  # its first occurrence
    answer = engine.generate(8, sampling_params={**natural, "stop_token_ids": [stop]})
    reason = _finish(answer)
    _expect(answer["output_ids"] == free[: cut + 1],
            f"with stop_token_ids [{stop}] the output must end at its first occurrence, inclusive "
            f"({free[: cut + 1]}), got {answer['output_ids']}")
    _expect(reason.get("type") == "stop" and reason.get("matched") in (stop, [stop]),
            f"finish_reason must be {{'type': 'stop', 'matched': {stop}}}, got {reason}")
    ignored = engine.generate(8, sampling_params={"stop_token_ids": [stop]})  # ignore_eos: true
    _expect(len(ignored["output_ids"]) == 8,
            f"ignore_eos switches off every stop token, stop_token_ids included (SGLang); got {ignored['output_ids']}")


@_check
def check_bad_request(engine: EngineUnderTest) -> None:
    status, raw = engine.call("POST", "/generate", {"sampling_params": {"max_new_tokens": 2}})
    _expect(status == 400, f"a request without text or input_ids must be refused with 400, got HTTP {status}: {raw[:200]!r}")
    status, raw = engine.call("POST", "/pause_generation", {"mode": "sideways"})
    _expect(400 <= status < 500, f"an unknown pause mode must be a 4xx, got HTTP {status}: {raw[:200]!r}")
    engine.generate(2)  # still serving


# ---------------------------------------------------------------------- abort and pause


@_check
def check_abort_rid(engine: EngineUnderTest) -> None:
    victim, bystander = f"contract-victim-{uuid.uuid4().hex}", f"contract-bystander-{uuid.uuid4().hex}"
    with _background(engine) as pool:
        long = pool.submit(engine.generate, engine.long_tokens, rid=victim, return_logprob=True)
        short = pool.submit(engine.generate, 16, rid=bystander)
        time.sleep(engine.settle_s)
        engine.ok("POST", "/abort_request", {"rid": victim})
        aborted = long.result()
        done = short.result()
    _expect(_finish(aborted).get("type") == "abort", f"the aborted request finished with {_finish(aborted)}")
    tokens = aborted["meta_info"].get("completion_tokens", 0)
    _expect(tokens < engine.long_tokens and len(aborted["output_ids"]) == tokens,
            f"the aborted request reports {tokens} completion tokens and {len(aborted['output_ids'])} output ids")
    _expect(_finish(done).get("type") == "length" and len(done["output_ids"]) == 16,
            f"a request running beside the aborted one must finish untouched, got {_finish(done)}")


@_check
def check_abort_all(engine: EngineUnderTest) -> None:
    with _background(engine) as pool:
        futures = [pool.submit(engine.generate, engine.long_tokens, rid=f"contract-all-{i}-{uuid.uuid4().hex}")
                   for i in range(3)]
        time.sleep(engine.settle_s)
        engine.ok("POST", "/abort_request", {"abort_all": True})
        reasons = [_finish(f.result()).get("type") for f in futures]
    _expect(reasons == ["abort"] * 3, f"abort_all must end every request with finish reason abort, got {reasons}")


@_check
def check_pause_abort(engine: EngineUnderTest) -> None:
    with _background(engine) as pool:
        running = pool.submit(engine.generate, engine.long_tokens)
        time.sleep(engine.settle_s)
        engine.ok("POST", "/pause_generation", {"mode": "abort"})
        _expect(_finish(running.result()).get("type") == "abort",
                f"pause mode abort must end in-flight requests with finish reason abort, got {_finish(running.result())}")
        status, raw = engine.call("POST", "/flush_cache", {})
        _expect(status == 200, f"/flush_cache of a paused, idle engine answered HTTP {status}: {raw[:200]!r}")
        queued = pool.submit(engine.generate, 4)
        _expect(_still_waiting(queued, 1.0), "a request sent while paused finished before /continue_generation")
        answer = engine.ok("POST", "/continue_generation", {})
        _expect(isinstance(answer, dict) and answer.get("status") == "ok", f"/continue_generation answered {answer!r}")
        _expect(_finish(queued.result()).get("type") == "length", "the request held by the pause did not finish after it")


def _pause_holds(engine: EngineUnderTest, mode: str) -> None:
    with _background(engine) as pool:
        running = pool.submit(engine.generate, engine.long_tokens, return_logprob=True)
        time.sleep(engine.settle_s)
        answer = engine.ok("POST", "/pause_generation", {"mode": mode})
        _expect(isinstance(answer, dict) and answer.get("status") == "ok", f"/pause_generation answered {answer!r}")
        _expect(_still_waiting(running, 1.0), f"pause mode {mode} must hold in-flight requests, but one finished")
        status, _ = engine.call("POST", "/flush_cache", {})
        _expect(status == 400, f"/flush_cache must refuse (400) while a {mode} pause holds requests, got HTTP {status}")
        engine.ok("POST", "/continue_generation", {})
        out = running.result()
    _expect(_finish(out).get("type") == "length" and len(out["output_ids"]) == engine.long_tokens,
            f"after a {mode} pause the request must run to its length ({engine.long_tokens}), got "
            f"{len(out['output_ids'])} tokens and {_finish(out)}")
    _expect(len(out["meta_info"].get("output_token_logprobs") or []) == engine.long_tokens,
            f"after a {mode} pause every token must still have its log-prob")


@_check
def check_pause_retract(engine: EngineUnderTest) -> None:
    _pause_holds(engine, "retract")


@_check
def check_pause_in_place(engine: EngineUnderTest) -> None:
    _pause_holds(engine, "in_place")


# ---------------------------------------------------------------------- weights and memory


@_check
def check_update_weight_version(engine: EngineUnderTest) -> None:
    original, version = engine.weight_version(), f"contract-{uuid.uuid4().hex[:8]}"
    try:
        engine.set_version(version)
        _expect(engine.weight_version() == version, f"/model_info reports {engine.weight_version()!r} after setting {version!r}")
        tagged = engine.generate(2)["meta_info"].get("weight_version")
        _expect(str(tagged) == version, f"generate tags its output with weight_version {tagged!r}, expected {version!r}")
    finally:
        engine.set_version(original)


def _model_path(engine: EngineUnderTest) -> str:
    if engine.model_path is None:
        raise EngineCheckSkipped("needs model_path (the folder the engine loaded)")
    return engine.model_path


@_check
def check_update_weights_from_disk(engine: EngineUnderTest) -> None:
    path, original = _model_path(engine), engine.weight_version()
    try:
        answer = engine.ok("POST", "/update_weights_from_disk", {"model_path": path, "weight_version": "contract-disk"})
        _expect(answer.get("success") is True, f"/update_weights_from_disk answered {answer!r:.300}")
        _expect(engine.weight_version() == "contract-disk", "a weight_version sent with the update was not adopted")
        engine.ok("POST", "/update_weights_from_disk", {"model_path": path})
        _expect(engine.weight_version() == "contract-disk", "an update without weight_version must keep the version")
        status, raw = engine.call("POST", "/update_weights_from_disk", {"model_path": f"{path}/no-such-folder"})
        body = json.loads(raw or b"{}")
        _expect(status == 400 and body.get("success") is False,
                f"a missing folder must be refused with 400 and success false, got HTTP {status}: {raw[:200]!r}")
    finally:
        engine.set_version(original)


@_check
def check_weights_checker(engine: EngineUnderTest) -> None:
    path = _model_path(engine)
    before = engine.generate(8)["output_ids"]
    engine.ok("POST", "/weights_checker", {"action": "snapshot"})
    engine.ok("POST", "/weights_checker", {"action": "reset_tensors"})
    status, raw = engine.call("POST", "/weights_checker", {"action": "compare"})
    _expect(status == 400 and json.loads(raw or b"{}").get("success") is False,
            f"compare after reset_tensors must fail with 400, got HTTP {status}: {raw[:200]!r}")
    engine.ok("POST", "/update_weights_from_disk", {"model_path": path})
    answer = engine.ok("POST", "/weights_checker", {"action": "compare"})
    _expect(answer.get("success") is True, f"compare after reloading {path} must pass bit-exactly, got {answer!r:.300}")
    _expect(engine.generate(8)["output_ids"] == before, "greedy output changed after reset and reload")


@_check
def check_memory_release(engine: EngineUnderTest) -> None:
    before = engine.generate(8)["output_ids"]
    tags = None if engine.model_path else ["kv_cache", "cuda_graph"]  # weights may be lost: reload them
    engine.ok("POST", "/pause_generation", {"mode": "abort"})
    try:
        engine.ok("POST", "/release_memory_occupation", {"tags": tags})
        engine.ok("POST", "/resume_memory_occupation", {"tags": tags})
        if tags is None:
            engine.ok("POST", "/update_weights_from_disk", {"model_path": engine.model_path})
    finally:
        engine.ok("POST", "/continue_generation", {})
    _expect(engine.generate(8)["output_ids"] == before, "greedy output changed after releasing and resuming memory")


@_check
def check_auth(engine: EngineUnderTest) -> None:
    if not engine.token:
        raise EngineCheckSkipped("needs the engine's token")
    status, _ = engine.call("POST", "/generate", {"input_ids": list(engine.prompt_ids)}, auth=False)
    _expect(status == 401, f"/generate without the token must answer 401, got HTTP {status}")
    status, _ = engine.call("POST", "/update_weight_version", {"new_version": "x"}, auth=False)
    _expect(status == 401, f"/update_weight_version without the token must answer 401, got HTTP {status}")
    status, _ = engine.call("GET", "/health", auth=False)
    _expect(status == 200, f"/health must not need the token, got HTTP {status}")


def main(argv: list[str] | None = None) -> int:
    """``python -m miles_contracts.testing.engine URL [--model-path DIR] [--token-env VAR]``: run
    every check against a live engine; prints one JSON line per check, exits 1 if any failed."""
    import argparse
    import os

    parser = argparse.ArgumentParser(prog="python -m miles_contracts.testing.engine", description=main.__doc__)
    parser.add_argument("url")
    parser.add_argument("--model-path", help="the folder the engine loaded (enables the weight checks)")
    parser.add_argument("--token-env", default="MILES_AUTH_TOKEN", help="environment variable holding the token")
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--only", nargs="*", choices=sorted(ENGINE_CHECKS))
    args = parser.parse_args(argv)
    engine = EngineUnderTest(args.url, token=os.environ.get(args.token_env) or None, model_path=args.model_path,
                             long_tokens=args.long_tokens)
    failed = 0
    for name in args.only or list(ENGINE_CHECKS):
        started = time.perf_counter()
        try:
            ENGINE_CHECKS[name](engine)
            outcome, detail = "passed", ""
        except EngineCheckSkipped as exc:
            outcome, detail = "skipped", str(exc)
        except AssertionError as exc:
            outcome, detail = "failed", str(exc)
            failed += 1
        print(json.dumps({"check": name, "outcome": outcome, "seconds": round(time.perf_counter() - started, 2),
                          "detail": detail}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
