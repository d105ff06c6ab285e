"""SGLang side of ``miles bench engine``, run by SGLang's own Python (no Miles imports: SGLang pins
its own transformers and lives in an environment of its own).

Reads a job as JSON on stdin (model folder, prompt token ids, sampling, concurrencies, repeats,
engine settings), starts ``sglang.Engine`` in process once, then per concurrency runs one warm-up
and ``repeats`` timed rounds of ``c`` requests submitted at once, timed until the last finished
(prefill included): what the embedded system measures. Token ids in and out, no prefix cache, as
the embedded engine. Writes ``{"warmups": {c: {...}}, "runs": {c: [{"tokens", "seconds"}]},
"startup_s", "server"}`` to the job's ``result_path`` (a warm-up is each concurrency's first,
untimed round). SGLang starts scheduler processes (spawn), hence the ``__main__`` guard.
"""

import json
import sys
import time

SERVER_KEYS = ("attention_backend", "sampling_backend", "cuda_graph_max_bs", "max_running_requests",
               "mem_fraction_static", "chunked_prefill_size", "disable_radix_cache", "max_total_num_tokens", "dtype")


def main() -> None:
    job = json.loads(sys.stdin.read())
    import sglang

    started = time.perf_counter()
    engine = sglang.Engine(
        model_path=job["model"], dtype=job["dtype"], attention_backend=job["attention_backend"],
        sampling_backend="pytorch", grammar_backend="none", disable_radix_cache=True, skip_tokenizer_init=True,
        cuda_graph_max_bs=max(job["concurrencies"]), random_seed=0, log_level="warning",
        mem_fraction_static=job["mem_fraction_static"],
    )
    startup = time.perf_counter() - started
    params = {"temperature": job["temperature"], "top_p": 1.0, "top_k": -1, "max_new_tokens": job["max_new_tokens"],
              "ignore_eos": True}
    prompts = job["prompts"]

    def one_round(c):
        batch = [prompts[i % len(prompts)] for i in range(c)]
        t = time.perf_counter()
        outs = engine.generate(input_ids=batch, sampling_params=params)
        seconds = time.perf_counter() - t
        outs = outs if isinstance(outs, list) else [outs]
        return {"tokens": sum(o["meta_info"]["completion_tokens"] for o in outs), "seconds": seconds}

    warmups, runs = {}, {}
    for c in job["concurrencies"]:
        warmups[str(c)] = one_round(c)  # untimed in the summary: graphs, allocator at this batch size
        runs[str(c)] = [one_round(c) for _ in range(job["repeats"])]
        print(f"  sglang    c={c:<3} {runs[str(c)][-1]['tokens'] / runs[str(c)][-1]['seconds']:8.1f} tok/s",
              file=sys.stderr, flush=True)
    info = engine.get_server_info()
    result = {"warmups": warmups, "runs": runs, "startup_s": round(startup, 1), "version": sglang.__version__,
              "server": {k: info.get(k) for k in SERVER_KEYS if k in info}}
    engine.shutdown()
    with open(job["result_path"], "w") as handle:
        json.dump(result, handle, default=str)


if __name__ == "__main__":
    main()
