"""TRL's GRPOTrainer on the learning-test task, for a side-by-side with `miles train`.

    python scripts/learning/trl_grpo.py --model PATH --steps 40 --out DIR

Same model, prompts (Miles' `arithmetic` source, digits=2), reward (Miles' `exact_match`),
batch (32 prompts x 8 completions per step), sampling (temperature 1.0, 32 new tokens), learning
rate and GRPO normalisation as scripts/learning/arithmetic_h200.yaml. Writes DIR/trl.json with
per-step wall time, generated tokens, reward, and DIR/final (the trained model).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-6)
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from miles.config import MilesConfig
    from miles.context import context_for
    from miles.data.source import open_data_source
    from miles.rewards.exact_match import exact_match_score
    from miles.sections import DataSection
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    source = open_data_source(context_for(MilesConfig(data=DataSection(source="arithmetic", options={"digits": 2}))))
    prompts = source.next_prompts(args.steps * args.prompts_per_step)
    dataset = Dataset.from_list([{"prompt": s.prompt, "label": s.label} for s in prompts])

    def reward(prompts, completions, label, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [exact_match_score(text, answer) for text, answer in zip(texts, label, strict=True)]

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    completions_per_step = args.prompts_per_step * args.generations
    config = GRPOConfig(
        output_dir=str(args.out / "trl"),
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        per_device_train_batch_size=completions_per_step,
        gradient_accumulation_steps=1,
        num_generations=args.generations,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        beta=0.0,
        num_iterations=1,
        scale_rewards="group",
        loss_type="dapo",  # token-level mean over the batch, like Miles' token_mean reduction
        gradient_checkpointing=False,  # Miles does not checkpoint activations by default either
        bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        shuffle_dataset=False,
    )

    log: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, _args, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, _args, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            log.append({"step": state.global_step, "seconds": time.perf_counter() - self.start})

        def on_log(self, _args, state, control, logs=None, **kw):
            if logs and log and "reward" in logs:
                log[-1].update({k: logs[k] for k in logs if isinstance(logs[k], (int, float))})

    trainer = GRPOTrainer(model=args.model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Timer()])
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    trainer.save_model(str(args.out / "final"))
    tokenizer.save_pretrained(str(args.out / "final"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "trl.json").write_text(json.dumps({"total_seconds": total, "steps": log}, indent=1))


if __name__ == "__main__":
    main()
