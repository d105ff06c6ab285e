"""SGLang side of ``miles bench engine --sessions``, run by SGLang's own Python (no Miles imports).

Reads a job as JSON on stdin, starts ``sglang.Engine`` once with its radix cache on or off
(``disable_radix_cache``), plays one untimed warm-up session and ``repeats`` timed sessions of the
embedded side's workload: turn ``t`` sends the history plus ``user_tokens`` random ids drawn by
``random.Random(seed).randrange(100, vocab_size)`` (the same draws as ``bench/sessions.py``), and
``answer_tokens`` greedy tokens come back. Per turn: latency (submit to answer) and prefilled
tokens (``prompt_tokens - cached_tokens`` of its answer). Writes ``{"runs": [{"latency_s",
"prefill_tokens", "cached_tokens"}], "startup_s", "version"}`` to the job's ``result_path``.
"""

import json
import random
import sys
import time


def play(engine, job, seed):
    rng = random.Random(seed)
    params = {"temperature": 0.0, "max_new_tokens": job["answer_tokens"], "ignore_eos": True}
    history, run = [], {"latency_s": [], "prefill_tokens": [], "cached_tokens": []}
    for _ in range(job["turns"]):
        history += [rng.randrange(100, job["vocab_size"]) for _ in range(job["user_tokens"])]
        started = time.perf_counter()
        answer = engine.generate(input_ids=list(history), sampling_params=params)
        run["latency_s"].append(time.perf_counter() - started)
        meta = answer["meta_info"]
        cached = int(meta.get("cached_tokens", 0))
        run["cached_tokens"].append(cached)
        run["prefill_tokens"].append(int(meta["prompt_tokens"]) - cached)
        history += list(answer["output_ids"])
    return run


def main() -> None:
    job = json.loads(sys.stdin.read())
    import sglang

    started = time.perf_counter()
    engine = sglang.Engine(
        model_path=job["model"], dtype=job["dtype"], attention_backend=job["attention_backend"],
        sampling_backend="pytorch", grammar_backend="none", disable_radix_cache=job["disable_radix_cache"],
        skip_tokenizer_init=True, random_seed=0, log_level="warning", mem_fraction_static=job["mem_fraction_static"],
    )
    startup = time.perf_counter() - started
    play(engine, job, seed=10_000)  # untimed warm-up, as the embedded arms
    runs = []
    for repeat in range(job["repeats"]):
        runs.append(play(engine, job, seed=repeat))
        print(f"  sessions sglang radix={not job['disable_radix_cache']} repeat {repeat}: last turn "
              f"{runs[-1]['latency_s'][-1] * 1000:8.1f} ms", file=sys.stderr, flush=True)
    engine.shutdown()
    with open(job["result_path"], "w") as handle:
        json.dump({"runs": runs, "startup_s": round(startup, 1), "version": sglang.__version__}, handle)


if __name__ == "__main__":
    main()
