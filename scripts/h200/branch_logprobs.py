"""Train/rollout log-prob gap per branch of the episodes one step recorded (issue 26's GPU check).

Reads ``RUN_DIR/samples/step_<N>.jsonl`` of a run made with ``run.dump_tokens=true`` (an episode's
other branches nest under ``branches``), scores every row's tokens with the transformers model at
``--model`` (teacher-forced, one forward per row) and compares, on the tokens the row trains
(``loss_mask`` 1), with the log-probs the engine sampled them with. Step 1's rollout ran on the
starting weights, so ``--model`` must be the run's ``model.name`` folder and ``--step 1``.

Prints JSON: per fork cause and per role (rows, trained tokens, mean and max |train - rollout|),
and the episodes' fork counts. Usage (on the device, after the run)::

    python3 scripts/h200/branch_logprobs.py /tmp/runs/compact-sglang --model /tmp/mh/models/... --out $OUT/x.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any


def rows_of(line: dict[str, Any]) -> list[dict[str, Any]]:
    return [line, *line.get("branches", [])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--model", required=True)
    parser.add_argument("--step", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # safetensors only: a weights folder is read as data, never unpickled (docs/design/security.md)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype), use_safetensors=True)
    model = model.to(device).eval()
    lines = [json.loads(x) for x in (args.run_dir / "samples" / f"step_{args.step:06d}.jsonl").read_text().splitlines()]
    gaps: dict[str, list[float]] = defaultdict(list)
    rows_by: Counter[str] = Counter()
    forks: Counter[str] = Counter()
    for line in lines:
        for row in rows_of(line):
            if "tokens" not in row:
                raise SystemExit("the dump has no tokens: run with run.dump_tokens=true")
            branch = row.get("branch") or {"cause": "linear", "role": "-"}
            if branch["cause"] not in ("root", "linear"):
                forks[branch["cause"]] += 1
            mask = row["loss_mask"]
            if not any(mask):
                continue
            tokens = torch.tensor([row["tokens"]], device=device)
            with torch.no_grad():
                logits = model(tokens).logits.float()
            logprobs = torch.log_softmax(logits[0, :-1], dim=-1).gather(1, tokens[0, 1:, None])[:, 0]
            start = len(row["tokens"]) - len(mask)
            for i, trained in enumerate(mask):
                if trained:
                    gap = abs(float(logprobs[start + i - 1]) - row["rollout_logprobs"][i])
                    gaps[f"cause/{branch['cause']}"].append(gap)
                    gaps[f"role/{branch['role']}"].append(gap)
            rows_by[f"cause/{branch['cause']}"] += 1
            rows_by[f"role/{branch['role']}"] += 1
    report = {
        "run_dir": str(args.run_dir), "step": args.step, "model": args.model, "dtype": args.dtype,
        "episodes": len(lines), "forks": dict(forks),
        "per_branch_kind": {key: {"rows": rows_by[key], "trained_tokens": len(values),
                                  "mean_abs_diff": round(statistics.fmean(values), 5),
                                  "max_abs_diff": round(max(values), 4)} for key, values in sorted(gaps.items())},
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
