"""What the batch-invariant MoE forward costs on CPU: the tiny Qwen3-MoE of the tests, fp32.

    OMP_NUM_THREADS=1 uv run python scripts/on_policy/moe_cost_cpu.py --repeats 5 \\
        --json docs/benchmarks/on-policy-moe-cpu.json

Two models from the same folder: transformers' default forward (sdpa attention, its default
experts implementation, batched ``F.linear``) and the true on-policy one (``invariant.register()``
attention, ``invariant.install_linears``, which installs ``miles_engine.invariant_moe``). Timed,
each the median of ``--repeats`` after one warm-up:

* ``moe_block``: one MoE layer (router + experts) alone on N tokens (a decode step of 1 token, a
  decode batch of 8, a prefill of 128), no gradient;
* ``moe_block_train``: forward + backward of that layer on 256 tokens;
* ``train_step``: forward + backward of the whole model on 4 rows x 64 tokens (what the fsdp
  trainer does per micro-batch, without FSDP and the optimizer; every linear, the attention and
  the head are the invariant ones too, so this is the whole true on-policy price, not MoE's alone).

Prints JSON: seconds per variant and the ratio invariant / default for each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()

    from miles_engine import invariant
    from miles_models.testing import tiny_model
    from transformers import AutoModelForCausalLM

    path = tiny_model("moe")
    default = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    exact = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=invariant.register())
    invariant.install_linears(exact)
    torch.manual_seed(0)
    out: dict[str, Any] = {"model": "tiny Qwen3-MoE (2 layers, hidden 64, 4 experts, top-2, expert width 32)",
                           "threads": torch.get_num_threads(), "repeats": args.repeats,
                           "default_experts_implementation": default.config._experts_implementation,
                           "moe_block": {}, "train_step": {}}
    for tokens in (1, 8, 128):
        hidden = torch.randn(1, tokens, 64)
        row: dict[str, float] = {}
        for name, model in (("default", default), ("invariant", exact)):
            block = model.model.layers[0].mlp

            def run(block: Any = block, hidden: torch.Tensor = hidden) -> None:
                with torch.no_grad():
                    block(hidden)

            row[name] = _median_seconds(run, args.repeats)
        row["ratio"] = row["invariant"] / row["default"]
        out["moe_block"][f"{tokens}_tokens"] = row
    hidden = torch.randn(1, 256, 64)
    row = {}
    for name, model in (("default", default), ("invariant", exact)):
        block = model.model.layers[0].mlp

        def train(block: Any = block) -> None:
            block(hidden).square().mean().backward()
            block.zero_grad(set_to_none=True)

        row[name] = _median_seconds(train, args.repeats)
    row["ratio"] = row["invariant"] / row["default"]
    out["moe_block_train"] = row
    ids = torch.randint(3, 1000, (4, 64))
    for name, model in (("default", default), ("invariant", exact)):
        model.train()

        def step(model: Any = model) -> None:
            model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
            model.zero_grad(set_to_none=True)

        out["train_step"][name] = _median_seconds(step, args.repeats)
    out["train_step"]["ratio"] = out["train_step"]["invariant"] / out["train_step"]["default"]
    text = json.dumps(out, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
