"""The kernel's own config sections. Plugins add theirs through ``miles_register_config_sections``.

Fields that name a registered implementation carry ``Choice("<kind>")`` metadata; the loader checks
them against the registries, so ``algorithm.advantage: grpoo`` fails at start-up with the list of
registered estimators. Fields that decide what code runs or where the run's secrets go carry
``Privileged("<what it decides>")``: ``miles train --resume`` does not take them from a run folder
alone (:mod:`miles.loop.folder_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from miles_contracts import AlgorithmParams, LoRASpec
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


@dataclass(frozen=True, slots=True)
class Choice:
    """Marks a config field whose value(s) must be registered names of ``kind``."""

    kind: str


@dataclass(frozen=True, slots=True)
class Privileged:
    """Marks a config field that decides what code runs (an interpreter, a command or its flags, an
    import path, an environment that changes what a process loads) or where the run's secrets go
    (a server that receives the run's token or credentials from the environment). ``what`` says
    which, for the error that names the field.

    Annotate the whole field (``python: Annotated[str | None, Privileged("...")] = None``).
    """

    what: str


class Section(BaseModel):
    """Base of every config section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class PluginsSection(Section):
    """Which plugins load. ``enable`` switches to allow-list mode (essential plugins always load)."""

    enable: list[str] | None = None
    disable: list[str] = Field(default_factory=list)


class RunSection(Section):
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._-]+$", description="folder under output_dir; default miles-<date>-<time>")
    output_dir: Path = Path("runs")
    seed: int = 0
    deterministic: bool = Field(
        default=False,
        description="reproducible runs: every request carries a sampling_seed derived from seed and the sample's "
                    "index, and engines start in deterministic (batch-invariant) mode; two runs with the same config "
                    "then log the same metrics on fp32 CPU engines. Slower. What it covers, and what it cannot "
                    "(GPU kernels, other thread counts): docs/design/reproducibility.md",
    )
    steps: int = Field(default=4, ge=1, description="RL steps to run (the embedded default runs 10)")
    mode: Literal["sync", "one_step_off", "fully_async"] = Field(
        default="sync", description="one_step_off overlaps the next rollout with training; fully_async keeps "
        "generating all the time into a bounded buffer the trainer takes batches from (docs/design/async.md)",
    )
    save_every: int = Field(default=0, ge=0, description="checkpoint every N steps; 0 = no periodic checkpoints")
    save_final: bool = Field(
        default=True,
        description="checkpoint after the last step (weights and optimiser state, ~12 bytes per parameter in "
                    "fp32 with AdamW: ~1.7 GB for SmolLM2-135M). Off, `miles train --resume` restarts from the last "
                    "periodic checkpoint (save_every; the steps after it run again) or from step 0 when there is "
                    "none, and the final weights are kept only if export_hf is on",
    )
    keep_checkpoints: int = Field(
        default=1, ge=1,
        description="complete checkpoints kept in <run>/checkpoints; after each save the older ones and any "
                    "incomplete one (an interrupted save) are deleted, so a long run holds at most this many "
                    "(one more while a save is being written)",
    )
    export_hf: bool = Field(
        default=False, description="after the last step, write the model as a Hugging Face folder to <run>/hf "
                                   "(independent of save_final)",
    )
    dump_tokens: bool = Field(
        default=False, description="also write token ids, loss masks and log-probs to <run>/samples (what `miles "
                                   "replay` trains on again)",
    )
    weights_digest: bool = Field(
        default=False,
        description="log train/weights_digest every step: a 48-bit hash of the actor's weights after the update, "
                    "which `miles replay` checks its replayed step against (costs one pass over the full weights "
                    "per step, gathered like a weight sync); docs/design/debugging.md",
    )


class ModelSection(Section):
    name: str = Field(default="smollm2-135m-instruct", description="a model of `miles models list`, or a local folder")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(default="auto", description="auto: bf16 on CUDA, fp32 on CPU")
    device: Literal["auto", "cpu", "cuda"] = "auto"


class DataSection(Section):
    source: Annotated[str, Choice("data_source")] = Field(default="arithmetic", description="registered data source")
    path: str | None = Field(default=None, description="file or folder for file sources")
    eval_path: str | None = Field(default=None, description="held-out prompts; task sources generate their own")
    prompt_key: str = "prompt"
    label_key: str = "label"
    template: str | None = Field(default=None, description="format string applied to the prompt, e.g. 'Q: {prompt}'")
    system_prompt: str | None = None
    apply_chat_template: bool = True
    shuffle: bool = True
    seed: int = 0
    on_error: Literal["skip", "fail"] = Field(default="skip", description="malformed lines: skip and count, or fail")
    options: dict[str, Any] = Field(default_factory=dict, description="source-specific options")


class RolloutSection(Section):
    generator: Annotated[str, Choice("generator")] = "single_turn"
    engine: Annotated[str, Choice("service")] = Field(default="embedded", description="registered engine service")
    prompts_per_step: int = Field(default=4, ge=1, description="prompt groups trained per step")
    samples_per_prompt: int = Field(default=4, ge=1)
    over_sampling: float = Field(
        default=1.0, ge=1.0,
        description="draw at least this many times the groups needed; raised automatically when filters drop more",
    )
    max_new_tokens: int = Field(default=32, ge=1)
    max_context_len: int = Field(default=1024, ge=2)
    temperature: float = Field(default=1.0, ge=0.0, description="0: greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1
    stop: list[str] = Field(default_factory=list)
    filters: list[Annotated[str, Choice("filter")]] = Field(default_factory=lambda: ["no_aborted"])
    tools: list[Annotated[str, Choice("tool")]] = Field(default_factory=list)
    agent: Annotated[str, Choice("agent")] | None = None
    agent_timeout: float = Field(default=300.0, gt=0)
    max_turns: int = Field(default=8, ge=1)
    # Engines queue what they cannot run yet, so a high limit costs little, while a low one feeds
    # the engine one request per finished one: a prefill forward at nearly every decode step.
    concurrency: int = Field(default=256, ge=1, description="generator calls in flight")
    max_generator_failures: int = Field(
        default=32, ge=1, description="generator calls in a row that raise before the run stops with the last "
        "one's error (a generator that only fails would otherwise burn every prompt while the trainer waits); "
        "a call that returns resets the count",
    )
    max_staleness: int | None = Field(
        default=None, ge=0, description="fully_async: weight versions a group may lag behind the engines' when a batch "
        "is taken (current version minus its oldest token's). Workers start only as many groups per version as "
        "batches within the bound will train, and the trainer takes the oldest finished groups first; a group "
        "whose own generation outlives the bound is late (rollout.late_groups). None: no bound",
    )
    late_groups: Literal["train", "recycle"] = Field(
        default="train", description="fully_async: a group over rollout.max_staleness when taken is trained with the "
        "importance correction (train) or generated again from its prompt (recycle: counted async/late_recycled, "
        "trained as it is after 3 generations); never thrown away for lateness",
    )
    partial_rollout: bool = Field(
        default=True, description="fully_async: a generation a weight update aborted goes on under the new weights "
        "with the tokens it has (false: it ends aborted)",
    )
    unused_groups: Literal["recycle", "drop"] = Field(
        default="recycle", description="fully_async: a group with an aborted sample is regenerated from its prompt "
        "(recycle, at most 3 generations, plus up to 10 lost to engine or router aborts) or dropped; counted per "
        "outcome either way",
    )
    buffer_groups: int | None = Field(
        default=None, ge=1, description="fully_async: finished groups that may wait for the trainer (producers block "
        "when it is full); default 2 x prompts_per_step",
    )

    # true on-policy: docs/design/true-on-policy.md
    true_on_policy: bool = Field(default=False, description=(
        "engine and trainer run one batch-invariant forward (miles_engine.invariant), so in sync mode every "
        "token's train/rollout log-prob diff is exactly 0 (embedded engine, fsdp backend, fp32 CPU, dense models)"))
    true_on_policy_check: Literal["error", "metric"] = Field(default="error", description=(
        "true_on_policy in sync mode, a trainer log-prob that differs from the rollout's: error = the step fails "
        "naming step, sample and position; metric = counted in train/true_on_policy_mismatched_tokens"))

    @field_validator("temperature")
    @classmethod
    def _greedy_or_a_real_temperature(cls, value: float) -> float:
        if 0.0 < value < 1e-6:  # engines sample these greedily (SGLang's epsilon); the trainer would divide by it
            raise ValueError(f"temperature {value} is below 1e-6, which engines treat as greedy; use 0 for greedy")
        return value


class OverlongPenalty(Section):
    """DAPO's soft overlong punishment, added to a sample's reward after the reward scored it: 0 up
    to ``max_length - buffer`` model-written tokens, then falling linearly to ``-factor`` at
    ``max_length``, and ``-factor`` beyond (``miles.rewards.overlong``)."""

    max_length: int = Field(ge=1, description="L_max: model-written tokens at which the penalty is the whole factor")
    buffer: int = Field(ge=1, description="L_cache: the tokens below L_max over which the penalty grows")
    factor: float = Field(default=1.0, gt=0, allow_inf_nan=False, description="the penalty at L_max and beyond")

    @model_validator(mode="after")
    def _buffer_within_max_length(self) -> OverlongPenalty:
        if self.buffer > self.max_length:
            raise ValueError(f"reward.overlong.buffer ({self.buffer}) is larger than reward.overlong.max_length "
                             f"({self.max_length}); the penalty starts at max_length - buffer, which must not be negative")
        return self


class RewardSection(Section):
    name: Annotated[str, Choice("reward")] = "exact_match"
    timeout: float = Field(default=30.0, gt=0)
    remote_url: str | None = Field(default=None, description="endpoint of the `remote` reward")
    overlong: OverlongPenalty | None = Field(
        default=None, description="DAPO's soft overlong penalty on long responses (off when unset)")


class TrainSection(Section):
    backend: Annotated[str, Choice("train_backend")] = Field(
        default="fsdp", description="registered train backend; when the config leaves it out: fsdp if installed, "
                                    "else the one train backend that is (miles config show prints which)",
    )
    policy_loss: Annotated[str, Choice("policy_loss")] = "ppo_clip"
    lr: float = Field(default=1e-6, gt=0, description="the embedded default (no config file) takes 2e-5, sized for its "
                                                     "135M model and 10 steps (miles.embedded_default)")
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(default=0, ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    grad_clip: float = Field(default=1.0, gt=0)
    micro_batch_tokens: int = Field(default=4096, ge=1, description="token budget per micro-batch")
    updates_per_step: int = Field(default=1, ge=1, description="optimiser steps per RL step (mini-batches)")
    reuse_rollout_logprobs: bool = Field(default=False, description=(
        "take the rollout's per-token log-probs as the old (behaviour) policy instead of recomputing them in a "
        "trainer pass; needs rollout.true_on_policy, where they are exactly the trainer's "
        "(docs/design/true-on-policy.md)"))
    gradient_checkpointing: bool = False
    use_reference: bool = Field(default=False, description="keep a reference model (needed for a KL term)")
    use_critic: bool = False
    critic_lr: float = Field(default=1e-5, gt=0)
    teacher_model: str | None = Field(
        default=None, description="teacher for on-policy distillation (a model name or folder; same tokenizer)",
    )
    lora: LoRASpec | None = Field(
        default=None, description="train low-rank adapters on a frozen base instead of every weight; engines then "
        "receive the adapters only (docs/design/lora.md). null = full fine-tune",
    )


class WeightsSection(Section):
    transport: Annotated[str, Choice("weight_transport")] = "shared_memory"
    bucket_mb: int = Field(default=512, ge=1)
    check: bool = Field(default=False, description="fill engine weights with noise first; the sync must restore them bit-exactly")
    update_interval: int = Field(
        default=1, ge=1, description="fully_async: push weights to the engines every N train steps (and after the last)",
    )


class EvalSection(Section):
    every: int = Field(default=0, ge=0, description="evaluate every N steps; 0 = off")
    num_prompts: int = Field(default=32, ge=1)
    greedy: bool = True
    samples_per_prompt: int = Field(default=1, ge=1, description="k of pass@k")
    max_new_tokens: int | None = None


class TrackingSection(Section):
    trackers: list[Annotated[str, Choice("tracker")]] = Field(default_factory=lambda: ["jsonl"])
    project: str = "miles"


class ExecutorSection(Section):
    name: Annotated[str, Choice("executor")] = "local"
    startup_timeout: float = Field(default=600.0, gt=0)
    restart_engines: bool = True


class ResourcesSection(Section):
    """Where the run's processes go (``miles.placement``; docs/design/process-model.md)."""

    trainer_ranks: int = Field(
        default=1, ge=1, description="trainer processes (the backend's world size); one GPU each when the run has GPUs",
    )
    engines: int = Field(default=1, ge=1, description="inference engine processes")
    gpus_per_engine: int = Field(default=1, ge=1, description="GPUs each engine shards over (its tensor-parallel size)")
    colocate: bool = Field(
        default=True, description="trainer and engines share GPUs (weights by CUDA IPC); false: engines get GPUs "
        "of their own (weights by broadcast, weights.transport=broadcast)",
    )
    release_engine_memory: Literal["none", "kv_cache", "all"] = Field(
        default="none", description="colocated runs in run.mode sync: after each rollout the engines give back their "
        "KV cache (kv_cache), or KV cache, CUDA graphs and weights (all), while the trainer trains; weights come back "
        "before the weight sync, the rest right after it (docs/design/colocated-memory.md)",
    )
    nodes: int | None = Field(default=None, ge=1, description="machines to use; null: every node the executor offers")
    gpus_per_node: int | None = Field(
        default=None, ge=0, description="GPUs each machine offers; null: ask the executor (0: run on CPU)",
    )

    @model_validator(mode="after")
    def _engine_fits_a_node(self) -> ResourcesSection:
        k, per_node = self.gpus_per_engine, self.gpus_per_node
        if per_node and per_node % k:
            divisors = [d for d in range(1, per_node + 1) if per_node % d == 0]
            raise ValueError(f"gpus_per_engine ({k}) does not divide gpus_per_node ({per_node}); use one of "
                             f"{', '.join(map(str, divisors))}")
        return self


class AlgorithmSection(AlgorithmParams):
    """The ``algorithm`` section (see :class:`miles_contracts.AlgorithmParams`)."""

    advantage: Annotated[str, Choice("advantage")] = "grpo"
    correction: Annotated[str, Choice("mismatch_correction")] = "none"


CORE_SECTIONS: dict[str, type[BaseModel]] = {
    "plugins": PluginsSection,
    "run": RunSection,
    "model": ModelSection,
    "data": DataSection,
    "rollout": RolloutSection,
    "reward": RewardSection,
    "algorithm": AlgorithmSection,
    "train": TrainSection,
    "weights": WeightsSection,
    "eval": EvalSection,
    "tracking": TrackingSection,
    "executor": ExecutorSection,
    "resources": ResourcesSection,
}

MOVED_KEYS: dict[str, str] = {
    "rollout.num_engines": "resources.engines",
}
"""Keys that moved, old -> new: a config that uses the old spelling gets an error naming the new one."""
