"""Greedy held-out accuracy of a model folder on the learning-test task (same evaluator for all).

    python scripts/learning/eval_heldout.py --model PATH [--model PATH ...] --n 512 --out FILE.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", action="append", required=True)
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch
    from miles.config import MilesConfig
    from miles.context import context_for
    from miles.data.source import eval_prompts
    from miles.rewards.exact_match import exact_match_score
    from miles.sections import DataSection
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = eval_prompts(context_for(MilesConfig(data=DataSection(source="arithmetic", options={"digits": 2}))),
                           args.n)
    results = {}
    for path in args.model:
        tokenizer = AutoTokenizer.from_pretrained(path)
        tokenizer.padding_side = "left"
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
        texts = [tokenizer.apply_chat_template(s.prompt, tokenize=False, add_generation_prompt=True) for s in prompts]
        correct = 0
        for i in range(0, len(texts), 128):
            enc = tokenizer(texts[i:i + 128], return_tensors="pt", padding=True, add_special_tokens=False).to("cuda")
            with torch.no_grad():
                out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id)
            answers = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            correct += sum(exact_match_score(a, s.label) for a, s in zip(answers, prompts[i:i + 128], strict=True))
        results[path] = correct / len(prompts)
        print(path, results[path], flush=True)
    args.out.write_text(json.dumps({"n": len(prompts), "accuracy": results}, indent=1))


if __name__ == "__main__":
    main()
