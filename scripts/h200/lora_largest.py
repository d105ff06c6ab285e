"""LoRA on the largest shape: `miles train` with ``train.lora`` on a random-weight model of a
``miles bench train`` preset (default ``qwen3-8b``: Qwen3-8B's published config), trainer rank and
embedded engine on one GPU (issue 32, "the largest model shape that trains with LoRA on one H200
next to an engine").

    python3 scripts/h200/lora_largest.py --out $OUT                       # the H200 (after setup.sh)
    uv run python scripts/h200/lora_largest.py --preset tiny --device cpu --steps 2 --tokenizer <tiny model> --out /tmp/x   # here

The model folder (bf16 safetensors, the ``--tokenizer`` folder's tokenizer: SmolLM2's) is written
once under ``--work``. Then one run: the arithmetic task,
GRPO, ``--steps`` sync steps of ``--prompts`` x 4 samples, 32 new tokens, adapters of ``--rank``
on all seven projections, weights synced as adapters through CUDA IPC, no evaluation, checkpoint
or export. Memory: ``memory.used`` of the GPU (every process, caching allocators included: what
decides whether trainer and engine fit together), sampled by ``memory_bench.py``'s sampler. Step
time: the wall between consecutive steps' records, the first step left out. Prints one JSON object
and writes it to ``<out>/lora-largest-<preset>.json``; exits 1 when the run failed (its log's tail
is in the JSON).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_bench import Sampler, describe_run, nvml_reader, smi_reader, step_rows  # noqa: E402 (next to this script)

ROOT = Path(__file__).resolve().parents[2]


def write_model(preset: str, folder: Path, tokenizer: Path, device: str) -> int:
    """The preset's random-weight model in bf16 at ``folder`` (kept when already there); its
    parameter count. A vocabulary smaller than the tokenizer's grows to it (the tiny preset)."""
    import torch
    from miles_fsdp.bench import PRESETS
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not (folder / "config.json").exists():
        words = AutoTokenizer.from_pretrained(str(tokenizer))
        shape = dict(PRESETS[preset])
        shape["vocab_size"] = max(shape["vocab_size"], len(words))
        config = AutoConfig.for_model(shape.pop("model_type"), **shape)
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        partial = folder.with_name(folder.name + ".partial")
        model.save_pretrained(partial)
        words.save_pretrained(partial)
        partial.rename(folder)
        del model
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return sum(p.numel() for p in model.parameters())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-8b", help="a miles bench train preset (miles_fsdp.bench.PRESETS)")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank; 0 trains all weights (the baseline)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (4 samples each)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tokenizer", type=Path, default=ROOT / ".benchcfg")
    parser.add_argument("--work", type=Path, default=Path("/tmp/lora-largest"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--run-timeout", type=float, default=480.0)
    parser.add_argument("overrides", nargs="*", help="more `miles train` overrides (key=value)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)

    start = time.monotonic()
    folder = args.work / f"{args.preset}-bf16"
    params = write_model(args.preset, folder, args.tokenizer, args.device)
    written_s = time.monotonic() - start
    # --rank 0: the full fine-tune of the same shape, as the baseline (does it fit, at what memory and step).
    name = f"lora-{args.preset}-r{args.rank}" if args.rank else f"full-{args.preset}"
    overrides = [
        f"model.name={folder}", f"model.device={args.device}", f"run.output_dir={args.work / 'runs'}", f"run.name={name}",
        f"run.steps={args.steps}", "run.mode=sync", "eval.every=0", "run.export_hf=false", "run.save_final=false",
        "data.source=arithmetic", "data.options={digits: 2}", "reward.name=exact_match",
        f"rollout.prompts_per_step={args.prompts}", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=32",
        "rollout.filters=[no_aborted]", "train.backend=fsdp", "fsdp.compile=false", "train.lr=1e-5",
        f"train.lora={{rank: {args.rank}, alpha: {2 * args.rank}}}" if args.rank else "train.lora=null",
        "weights.transport=" + ("shared_memory" if args.device == "cuda" else "disk"), *args.overrides,
    ]
    read = (nvml_reader(0) or smi_reader(0)) if args.device == "cuda" else None
    sampler = Sampler(read, 0.5) if read is not None else None
    if sampler is not None:
        sampler.start()
    log = args.out / f"{name}.log"
    run_start = time.monotonic()
    with log.open("w") as out:
        try:
            rc = subprocess.run([sys.executable, "-m", "miles.cli.main", "train", *overrides], stdout=out,
                                stderr=subprocess.STDOUT, timeout=args.run_timeout, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    samples = sampler.stop() if sampler is not None else []
    rows = step_rows(args.work / "runs" / name / "metrics.jsonl")
    result = {
        "preset": args.preset, "parameters": params, "rank": args.rank, "device": args.device, "exit": rc,
        "model_written_s": round(written_s, 1), "run_wall_s": round(time.monotonic() - run_start, 1),
        **describe_run(rows, samples, skip=1),
        "sync_bytes": [r.get("weights/sync_bytes") for r in rows],
        "command": "miles train " + " ".join(overrides),
    }
    if rc != 0:
        result["log_tail"] = log.read_text()[-3000:]
    text = json.dumps(result, indent=1)
    print(text)
    (args.out / (f"lora-largest-{args.preset}.json" if args.rank else f"full-largest-{args.preset}.json")).write_text(text + "\n")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
