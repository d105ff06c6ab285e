"""vLLM side of ``miles bench engine``, run by vLLM's own Python (no Miles imports).

Reads a job as JSON on stdin (model, prompt token ids, sampling, concurrencies, repeats), loads
the model once, warms up, then times ``LLM.generate`` on ``c`` prompts at once, ``repeats`` times
per concurrency. Writes ``{"runs": {c: [{"tokens", "seconds"}, ...]}}`` to the job's ``result_path``
(vLLM prints its own logs on stdout).
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

    llm.generate(batch(max(job["concurrencies"])), params, use_tqdm=False)  # warm-up
    runs = {}
    for c in job["concurrencies"]:
        runs[c] = []
        for _ in range(job["repeats"]):
            started = time.perf_counter()
            outs = llm.generate(batch(c), params, use_tqdm=False)
            seconds = time.perf_counter() - started
            runs[c].append({"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": seconds})
    with open(job["result_path"], "w") as out:
        json.dump({"runs": runs}, out)


if __name__ == "__main__":
    main()
