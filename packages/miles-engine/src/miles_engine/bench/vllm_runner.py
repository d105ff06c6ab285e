"""vLLM side of ``miles bench engine``, run by vLLM's own Python (no Miles imports).

Reads a job as JSON on stdin (model, prompt token ids, sampling, concurrencies, repeats), loads
the model once, then per concurrency ``c`` runs ``LLM.generate`` on ``c`` prompts at once: one
warm-up, then ``repeats`` timed runs. Writes ``{"warmups": {c: {"tokens", "seconds"}}, "runs": {c:
[{"tokens", "seconds"}, ...]}}`` to the job's ``result_path`` (vLLM prints its own logs on stdout).
vLLM starts worker processes, hence the ``__main__`` guard.
"""

import json
import sys
import time


def main() -> None:
    job = json.loads(sys.stdin.read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=job["model"], dtype="float32", max_model_len=2048, seed=0)
    params = SamplingParams(max_tokens=job["max_new_tokens"], temperature=job["temperature"], top_p=1.0, top_k=-1,
                            ignore_eos=True)
    prompts = job["prompts"]

    def batch(c):
        return [TokensPrompt(prompt_token_ids=prompts[i % len(prompts)]) for i in range(c)]

    def timed(c):
        started = time.perf_counter()
        outs = llm.generate(batch(c), params, use_tqdm=False)
        return {"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": time.perf_counter() - started}

    warmups, runs = {}, {}
    for c in job["concurrencies"]:
        warmups[c] = timed(c)
        runs[c] = [timed(c) for _ in range(job["repeats"])]
    with open(job["result_path"], "w") as out:
        json.dump({"warmups": warmups, "runs": runs}, out)


if __name__ == "__main__":
    main()
