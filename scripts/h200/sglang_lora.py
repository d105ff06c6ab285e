"""LoRA adapters on a live SGLang server, with the calls Miles plans for adapter syncs (issue 32).

    python3 scripts/h200/sglang_lora.py --model /tmp/sgmodel --out $OUT --sglang-env PYTHONPATH=/tmp/sg ...

SGLang is started from ``miles_sglang.launch_plan(..., lora=spec)`` (``--enable-lora``, rank,
target modules) through the kernel's LocalExecutor, with a fresh token. Three adapter versions
(random ``B``, so each changes the model) are written as PEFT folders by
``miles_engine.lora.write_peft_adapter`` and synced with ``miles_sglang.lora.adapter_sync_calls``.
After each sync the teacher-forced log-probs SGLang returns for a request carrying
``request_fields(version)`` are compared with transformers running the same adapter unmerged
(``miles_engine.lora``, fp32); a request without the field must give the base. After version 3,
version 1 must be off SGLang's list of loaded adapters, refused once its folder is deleted (SGLang
loads an unloaded adapter again when a request names it, from its folder; the transport deletes a
retired version's folder), and version 2 still served. Writes one
JSON line per check to ``--out``/sglang_lora.jsonl and stdout; exits 1 if any failed.
"""

from __future__ import annotations

import json
import secrets
import shutil
import sys
import time

PROMPT = [1, 504, 3458, 282, 253, 1345, 28, 314, 2843, 357, 8, 5922, 2030, 30, 198, 2016, 2016, 506, 701, 3120]


def _reference_logprobs(model_dir: str, adapters: dict | None, spec) -> list[float]:
    """Teacher-forced log-probs of PROMPT[1:] from transformers (fp32, CUDA), with ``adapters`` unmerged."""
    import torch
    from miles_engine.lora import attach_lora
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    if adapters is not None:
        attach_lora(model, spec)
        model.load_state_dict({k: v.float() for k, v in adapters.items()}, strict=False)
    ids = torch.tensor([PROMPT], device="cuda")
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    picked = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    return picked.tolist()


def _adapter(model_dir: str, spec, seed: int) -> dict:
    """Adapter tensors (PEFT names without the prefix) with random ``A`` and ``B``."""
    import torch
    from miles_engine.lora import attach_lora, is_adapter_tensor
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    attach_lora(model, spec)
    tensors = {}
    for name, param in model.named_parameters():
        if is_adapter_tensor(name):
            tensors[name] = param.detach().clone() if ".lora_A." in name else torch.randn_like(param) * 0.05
    return tensors


def main() -> int:
    from live_check import exit_status, server_arguments, write_results  # next to this script

    parser = server_arguments()
    parser.add_argument("--tolerance", type=float, default=0.05, help="max |log-prob difference| (SGLang runs bf16)")
    args = parser.parse_args()

    import httpx
    from miles.executor.local import LocalExecutor
    from miles_contracts import EngineSpec
    from miles_contracts.lora import LoRASpec
    from miles_engine.lora import write_peft_adapter
    from miles_sglang import SGLangSection, launch_plan
    from miles_sglang.lora import adapter_sync_calls, request_fields

    args.out.mkdir(parents=True, exist_ok=True)
    spec = LoRASpec(rank=8, alpha=16.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                        "down_proj"])
    token = secrets.token_hex(16)
    section = SGLangSection(python=args.sglang_python, env=dict(kv.split("=", 1) for kv in args.sglang_env),
                            mem_fraction_static=0.5, disable_radix_cache=True, log_level="info",
                            sglang_args=["--grammar-backend", "none", "--disable-cuda-graph"])
    engine = EngineSpec(model_path=args.model, port=args.port)
    plan = launch_plan(engine, section, authenticated=True, lora=spec)
    print("launch:", " ".join(plan.command()), flush=True)
    results: list[dict] = []

    def record(check: str, ok: bool, **detail: object) -> None:
        row = {"check": check, "outcome": "passed" if ok else "failed", **detail}
        results.append(row)
        print(json.dumps(row), flush=True)

    executor = LocalExecutor(args.out, startup_timeout=480)
    client = httpx.Client(base_url=engine.url, headers={"Authorization": f"Bearer {token}"}, timeout=120)

    def served(fields: dict) -> httpx.Response:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                "return_logprob": True, "logprob_start_len": 0, **fields}
        return client.post("/generate", json=body)

    def logprobs(response: httpx.Response) -> list[float]:
        response.raise_for_status()
        return [entry[0] for entry in response.json()["meta_info"]["input_token_logprobs"][1:]]

    started = time.perf_counter()
    try:
        executor.start("sglang", plan.command(), health_url=f"{engine.url}/health", env={"MILES_AUTH_TOKEN": token})
        print(f"SGLang healthy after {time.perf_counter() - started:.0f} s", flush=True)
        base_want = _reference_logprobs(args.model, None, spec)
        base_got = logprobs(served({}))
        gap = max(abs(a - b) for a, b in zip(base_got, base_want, strict=True))
        record("base without lora_path", gap < args.tolerance, max_abs_diff=gap)
        unload_answer: dict = {}
        for version in (1, 2, 3):
            adapters = _adapter(args.model, spec, seed=version)
            folder = args.out / "adapters" / f"v{version}"
            write_peft_adapter(folder, adapters, spec, args.model)
            paused, after = adapter_sync_calls(version, str(folder))
            t = time.perf_counter()
            for call in [*paused, *after]:
                response = client.post(call.path, json=call.body)
                record(f"v{version} {call.path}", response.is_success, status=response.status_code,
                       body=response.text[:300])
                if call.path == "/unload_lora_adapter" and response.is_success:
                    unload_answer = response.json()
            sync_s = time.perf_counter() - t
            want = _reference_logprobs(args.model, adapters, spec)
            got = logprobs(served(request_fields(version)))
            gap = max(abs(a - b) for a, b in zip(got, want, strict=True))
            moved = max(abs(a - b) for a, b in zip(want, base_want, strict=True))
            record(f"v{version} served by its adapter", gap < args.tolerance and moved > 4 * args.tolerance,
                   max_abs_diff=gap, adapter_effect=moved, sync_seconds=round(sync_s, 3),
                   adapter_bytes=sum(t.numel() * t.element_size() for t in adapters.values()))
        # SGLang 0.5.13 treats an unloaded adapter as evicted: a request naming it loads it again
        # from its folder (found on the H200, 2026-12-02). So "unloaded" is checked on the engine's
        # own list, and Miles' transport deletes a retired version's folder: a late request naming
        # it then fails instead of being served by a retired version.
        record("v1 not listed after v3", "miles-v1" not in unload_answer.get("loaded_adapters", {}))
        shutil.rmtree(args.out / "adapters" / "v1")
        record("v1 refused once its folder is gone", not served(request_fields(1)).is_success)
        record("v2 still served after v3", served(request_fields(2)).is_success)
    finally:
        client.close()
        executor.shutdown()
        write_results(args.out / "sglang_lora.jsonl", results)
    return exit_status(results)


if __name__ == "__main__":
    sys.exit(main())
