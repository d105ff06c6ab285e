"""``miles bench train --tree``: the same training step with rows run flat and as prefix trees.

Two workloads, each a batch whose rows share prefixes the way RL batches do:

* ``grpo``: ``groups`` prompts of ``prompt`` tokens, each with ``samples`` completions of
  ``completion`` tokens (the issue's shape: 8 x 256 on a 2K prompt), rows shuffled across groups;
* ``episodes``: a group of agent episodes on one task, shaped like ``miles bench episode-tokens``'s
  default workload: a system prompt and a task shared by every row, turns of an answer plus a tool
  result, the history compacted (replaced by a summary) every few turns (one row per compaction
  epoch) and a sub-agent row with its own system prompt; answers are trained, the rest is context.

For each workload the fsdp backend trains the same batch from the same random weights with
``fsdp.prefix_tree: off`` (the flat layout the backend would pick: padded or packed) and ``on``
(micro-batches planned by tree size, each one tree, for each attention implementation asked
for), under the same ``train.micro_batch_tokens``, each after ``warmup``
untimed steps, then ``repeats`` timed steps; the JSON holds tokens computed (what the layers see)
against flattened tokens, median step time with min/max, the flat/tree ratios, and the first
step's loss and gradient norm of each (the same weights and batch: equal up to rounding).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from miles_fsdp.bench import Device, _free, _sync, build_model

if TYPE_CHECKING:
    from miles_contracts import RunContext, TrainBatch


@dataclass(frozen=True, slots=True)
class EpisodeShape:
    """Token counts of the ``episodes`` workload (defaults: ``miles bench episode-tokens``'s episode)."""

    episodes: int = 4
    system: int = 600
    task: int = 200
    answer: int = 120
    tool: int = 300
    turns: int = 24
    compact_every: int = 6
    summary: int = 150
    sub_agent_system: int = 300
    sub_agent_turns: int = 4

    def scaled(self, factor: float) -> EpisodeShape:
        """Every length times ``factor`` (at least 1 token; counts of turns and episodes unchanged)."""
        def s(n: int) -> int:
            return max(1, round(n * factor))

        return EpisodeShape(self.episodes, s(self.system), s(self.task), s(self.answer), s(self.tool), self.turns,
                            self.compact_every, s(self.summary), s(self.sub_agent_system), self.sub_agent_turns)


def _rows_to_batch(rows: list[tuple[list[int], list[bool]]], seed: int) -> TrainBatch:
    """Right-padded batch; ``trained[i]`` marks the model-written tokens; advantages +-1 per row."""
    from miles_contracts import TrainBatch

    b, t = len(rows), max(len(ids) for ids, _ in rows)
    tokens = torch.zeros(b, t, dtype=torch.long)
    attention = torch.zeros(b, t, dtype=torch.long)
    loss_mask = torch.zeros(b, t)
    for r, (ids, trained) in enumerate(rows):
        tokens[r, : len(ids)] = torch.tensor(ids)
        attention[r, : len(ids)] = 1
        loss_mask[r, : len(ids)] = torch.tensor(trained, dtype=torch.float32)
    loss_mask[:, 0] = 0
    gen = torch.Generator().manual_seed(seed)
    advantages = torch.where(torch.rand(b, 1, generator=gen) > 0.5, 1.0, -1.0) * loss_mask
    return TrainBatch(tokens=tokens, attention_mask=attention, loss_mask=loss_mask, rollout_logprobs=torch.zeros(b, t),
                      rewards=torch.zeros(b), group_ids=torch.zeros(b, dtype=torch.long), rollout_ids=torch.arange(b),
                      advantages=advantages)


class _Tokens:
    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab, self.gen = vocab, torch.Generator().manual_seed(seed)

    def __call__(self, n: int) -> list[int]:
        return torch.randint(1, self.vocab, (n,), generator=self.gen).tolist()


def grpo_batch(vocab: int, *, prompt: int = 2048, samples: int = 8, completion: int = 256, groups: int = 1,
               seed: int = 0) -> TrainBatch:
    """``groups`` GRPO groups, each its own prompt; with several, the rows are shuffled (as a batch
    arrives from rollout: groups finish in any order)."""
    draw = _Tokens(vocab, seed)
    rows = []
    for _ in range(groups):
        head = draw(prompt)
        rows += [(head + draw(completion), [False] * prompt + [True] * completion) for _ in range(samples)]
    if groups > 1:
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
        rows = [rows[i] for i in order]
    return _rows_to_batch(rows, seed)


def episodes_batch(vocab: int, shape: EpisodeShape, seed: int = 0) -> TrainBatch:
    draw = _Tokens(vocab, seed)
    system, task, sub_system = draw(shape.system), draw(shape.task), draw(shape.sub_agent_system)
    rows: list[tuple[list[int], list[bool]]] = []

    def turn() -> tuple[list[int], list[bool]]:
        return draw(shape.answer) + draw(shape.tool), [True] * shape.answer + [False] * shape.tool

    for _ in range(shape.episodes):
        ids, trained = system + task, [False] * (shape.system + shape.task)
        for k in range(1, shape.turns + 1):
            more, marks = turn()
            ids, trained = ids + more, trained + marks
            if k % shape.compact_every == 0 or k == shape.turns:
                rows.append((ids, trained))  # the epoch's row; the next epoch restarts from a summary
                ids, trained = system + task + draw(shape.summary), [False] * (shape.system + shape.task + shape.summary)
        sub_ids, sub_trained = sub_system + task, [False] * (shape.sub_agent_system + shape.task)
        for _ in range(shape.sub_agent_turns):
            more, marks = turn()
            sub_ids, sub_trained = sub_ids + more, sub_trained + marks
        rows.append((sub_ids, sub_trained))
    return _rows_to_batch(rows, seed)


def _computed_tokens(backend: Any, batch: TrainBatch) -> tuple[int, int, int]:
    """(tokens the layers compute, micro-batches, of them run as trees) under ``backend``'s plan."""
    computed = trees = 0
    plan = backend.runner.my_micro_batches(batch)
    for rows in plan:
        _, inputs, _ = backend.runner._inputs(batch, rows)
        computed += inputs.num_tokens
        trees += int(inputs.seen_positions is not None)
    return computed, len(plan), trees


def _measure(preset: str, batch: TrainBatch, *, ctx: RunContext, device: Device, options: dict[str, Any],
             micro_batch_tokens: int, warmup: int, repeats: int) -> dict[str, Any]:
    from miles.config import MilesConfig
    from miles.sections import ModelSection, RunSection, TrainSection
    from miles.trainer.device import pick_device

    from miles_fsdp.backend import FSDPBackend
    from miles_fsdp.config import FSDPSection

    config = MilesConfig(
        model=ModelSection(device=device), run=RunSection(steps=warmup + repeats + 1),
        train=TrainSection(lr=1e-6, micro_batch_tokens=micro_batch_tokens), extra={"fsdp": FSDPSection(**options)},
    )
    model = build_model(preset, device=pick_device(device))
    model.set_attn_implementation(options.get("attn_implementation", "sdpa"))
    backend = FSDPBackend(ctx.with_config(config), actor=model)
    dev = backend.dist.device
    try:
        computed, micro_batches, trees = _computed_tokens(backend, batch)
        first = backend.train_step(batch)
        for _ in range(warmup - 1):
            backend.train_step(batch)
        times = []
        for _ in range(repeats):
            _sync(dev)
            start = time.perf_counter()
            backend.train_step(batch)
            _sync(dev)
            times.append(time.perf_counter() - start)
        return {
            "options": options, "computed_tokens": computed, "micro_batches": micro_batches, "tree_micro_batches": trees,
            "step_s_median": statistics.median(times), "step_s_min": min(times), "step_s_max": max(times),
            "step_s": times, "first_step_loss": first["loss"], "first_step_grad_norm": first["grad_norm"],
            "peak_memory_gb": torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None,
        }
    finally:
        backend.close()
        _free(dev)


def _auto_decisions(batch: TrainBatch, preset: str, attentions: list[str]) -> dict[str, bool]:
    """What ``fsdp.prefix_tree: auto`` would choose for the batch as one micro-batch, per attention kernel."""
    from miles_fsdp.bench import PRESETS
    from miles_fsdp.packing import row_lengths
    from miles_fsdp.passes import attention_pair_cost, layout_costs, worth_packing
    from miles_fsdp.prefix_tree import TreePolicy, build_prefix_tree

    pair_cost = attention_pair_cost(PRESETS[preset])
    padded, packed = layout_costs(batch.attention_mask, pair_cost)
    flat = packed if worth_packing(batch.attention_mask, pair_cost) else padded
    tree = build_prefix_tree(batch.tokens, row_lengths(batch.attention_mask))
    return {attention: TreePolicy("auto", attention, pair_cost).pays(tree, flat) for attention in attentions}


def run_tree_benchmark(*, ctx: RunContext, preset: str, device: Device, options: dict[str, Any], attentions: list[str],
                       warmup: int, repeats: int, scale: float, workloads: list[str], groups: int = 1,
                       micro_batch_tokens: int | None = None) -> dict[str, Any]:
    """The JSON report of ``miles bench train --tree`` (see the module docstring)."""
    from miles.trainer.device import pick_device

    from miles_fsdp.bench import PRESETS

    if warmup < 1 or repeats < 3:
        raise ValueError(f"--tree needs --warmup >= 1 and --steps >= 3 (repeats), got {warmup} and {repeats}")
    dev = pick_device(device)
    vocab = int(PRESETS[preset]["vocab_size"])
    prompt, completion = max(2, round(2048 * scale)), max(2, round(256 * scale))
    batches = {
        "grpo": grpo_batch(vocab, prompt=prompt, completion=completion, groups=groups),
        "episodes": episodes_batch(vocab, EpisodeShape().scaled(scale)),
    }
    report: dict[str, Any] = {
        "benchmark": "train --tree",
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": "bf16 compute, fp32 master weights" if dev.type == "cuda" else "fp32",
        "torch": torch.__version__, "model": preset, "scale": scale, "warmup": warmup, "repeats": repeats,
        "grpo_groups": groups,
        "workloads": {}, "goal_grpo": "tokens ratio >= 3, step speedup >= 2 on the H200, same loss",
    }
    for name in workloads:
        batch = batches[name]
        lengths = batch.attention_mask.sum(1)
        # the same budget for every arm: given, else one GRPO group's flat size (one group per flat
        # pass; the tree planner fits as many groups' trees as the budget holds), else the whole batch
        budget = micro_batch_tokens or (int(lengths.sum()) // groups if name == "grpo" else int(lengths.sum()))
        entry: dict[str, Any] = {"rows": batch.size, "flat_tokens": int(lengths.sum()), "row_lengths": lengths.tolist(),
                                 "trained_tokens": int(batch.loss_mask.sum()), "micro_batch_tokens": budget,
                                 "auto_takes_tree": _auto_decisions(batch, preset, attentions)}
        flat = _measure(preset, batch, ctx=ctx, device=device, options={**options, "prefix_tree": "off"},
                        micro_batch_tokens=budget, warmup=warmup, repeats=repeats)
        entry["flat"] = flat
        for attention in attentions:
            tree = _measure(preset, batch, ctx=ctx, device=device,
                            options={**options, "prefix_tree": "on", "attn_implementation": attention},
                            micro_batch_tokens=budget, warmup=warmup, repeats=repeats)
            tree["tokens_ratio"] = flat["computed_tokens"] / tree["computed_tokens"]
            tree["step_speedup"] = flat["step_s_median"] / tree["step_s_median"]
            tree["loss_relative_difference"] = abs(tree["first_step_loss"] - flat["first_step_loss"]) / max(
                abs(flat["first_step_loss"]), 1e-12)
            entry[f"tree_{attention}"] = tree
        report["workloads"][name] = entry
    return report
