"""`FSDPBackend`: the ``fsdp`` train backend (FSDP2 over Hugging Face causal LMs).

SPMD contract: with several ranks, every rank constructs the backend and calls every method with
the *same* arguments (the full batch, the same paths); the backend splits work over ranks itself
and every rank gets the full result back. Methods run collectives, so no rank may skip a call.

One ``train_step`` is ``train.updates_per_step`` optimiser steps. The batch (which already carries
advantages) is split into that many mini-batches, rows of one rollout staying together; each
mini-batch goes through ``miles_algorithms.objective.prepare_batch`` (its loss denominators), is
spread over ranks and micro-batches by token budget, and its gradient is accumulated, clipped and
applied. With a critic, the critic takes the same steps on the same mini-batches.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from miles.trainer.collectives import sum_over_ranks
from miles_algorithms.sdpa import sdpa_preference
from miles_engine import invariant
from miles_engine.lora import adapters_disabled, write_peft_adapter

from miles_fsdp.checkpoint import TrainedModule, load_checkpoint, save_checkpoint
from miles_fsdp.config import FSDPSection
from miles_fsdp.distributed import all_reduce_sum, release_distributed, setup_distributed
from miles_fsdp.lora import (
    adapter_state,
    attach_adapters,
    merged_weights,
    wrapped_weight_names,
)
from miles_fsdp.models import (
    PolicyModel,
    ValueModel,
    load_causal_lm,
    load_value_model,
    prepare_and_shard,
    resolve_precision,
)
from miles_fsdp.on_policy import OnPolicyCheck, incompatible_options
from miles_fsdp.optim import LRMultiplier, build_optimizer, build_scheduler
from miles_fsdp.passes import PassRunner, attention_pair_cost
from miles_fsdp.prefix_tree import TreePolicy
from miles_fsdp.weights import export_hf, gather_named_weights

LORA_EXPORT_DIR = "lora_adapter"  # export_hf's PEFT adapter, beside (not inside) the merged weights

if TYPE_CHECKING:
    from miles.config import MilesConfig
    from miles_algorithms.update import MicroLoss
    from miles_contracts import RunContext, TrainBatch
    from transformers import PreTrainedModel

NAME = "fsdp"
_PHASES = {"actor": "old_logprobs", "ref": "ref_logprobs", "teacher": "teacher_logprobs"}


class FSDPBackend:
    """Actor (+ optional reference, teacher, critic) sharded with FSDP2; satisfies ``TrainBackend``.

    :param ctx: the run as this process sees it: ``ctx.config`` (``model``, ``train``,
        ``algorithm``, ``rollout.temperature``, ``run.seed``/``run.steps`` and the ``fsdp`` section
        are read) and ``ctx.kernel``, whose plugins resolve model names, claim the model's bridge,
        wrap forwards and provide the policy loss and mismatch correction.
    :param actor: an already built HF causal LM to train instead of loading ``config.model.name``
        (benchmarks, tests); the reference, if any, is then a copy of it.
    """

    def __init__(self, ctx: RunContext, *, actor: PreTrainedModel | None = None) -> None:
        self.config = ctx.config
        self.kernel = ctx.kernel
        self.options = self.config.section(NAME, FSDPSection)
        self.dist = setup_distributed(self.config.model.device)
        try:
            self._build(self.config, actor)
        except BaseException:
            release_distributed(self.dist)  # a failed start must not leave a process group behind
            raise

    def _build(self, config: MilesConfig, actor: PreTrainedModel | None) -> None:
        self.precision = resolve_precision(config.model.dtype, self.dist.device, self.options.reduce_dtype)
        compiled = self.options.compile
        self.compiled = compiled if compiled is not None else self.dist.device.type == "cuda"
        torch.manual_seed(config.run.seed)  # same on every rank: identical critic head init before sharding
        attn = self.options.attn_implementation
        self.true_on_policy = config.rollout.true_on_policy
        self.on_policy_check: OnPolicyCheck | None = None
        if self.true_on_policy:
            errors = incompatible_options(self.options, rollout_temperature=config.rollout.temperature)
            if errors:
                raise ValueError("rollout.true_on_policy: " + "; ".join(errors))
            attn = invariant.register()
            self.compiled = False
            if config.run.mode == "sync":
                self.on_policy_check = OnPolicyCheck(config.rollout.true_on_policy_check)

        # model names (actor, teacher, critic) resolve through the kernel: a folder, or a plugin's model
        self.model_dir: Path | None = None
        if actor is None:
            self.model_dir = self.kernel.resolve_model(config.model.name)
            actor = load_causal_lm(self.model_dir, attn)
        elif self.true_on_policy:
            actor.set_attn_implementation(attn)
        # LoRA: the reference is the actor with its adapters off (no second copy)
        self.lora = config.train.lora
        copy_reference = config.train.use_reference and self.model_dir is None and self.lora is None
        reference = copy.deepcopy(actor) if copy_reference else None
        if self.lora is not None:
            attach_adapters(actor, self.lora, self.precision)
        self.hf_config: dict[str, Any] = actor.config.to_dict()
        self.bridge = self.kernel.find_model_bridge(self.hf_config)

        train = config.train
        self.actor = self._shard(PolicyModel(actor, invariant=self.true_on_policy), trainable=True)
        self.ref: PolicyModel | None = None
        if train.use_reference and self.lora is None:
            if reference is None:
                assert self.model_dir is not None  # an in-memory actor's reference is its copy
                reference = load_causal_lm(self.model_dir, attn)
            self.ref = self._shard(PolicyModel(reference, invariant=self.true_on_policy), trainable=False)
        self.teacher: PolicyModel | None = None
        if train.teacher_model:
            teacher_dir = self.kernel.resolve_model(train.teacher_model)
            self.teacher = self._shard(PolicyModel(load_causal_lm(teacher_dir, attn), invariant=self.true_on_policy),
                                       trainable=False)
        self.critic: ValueModel | None = None
        if train.use_critic:
            critic = self.options.critic_model
            source = self.kernel.resolve_model(critic) if critic else self.model_dir
            if source is None:
                raise ValueError("train.use_critic with an in-memory actor needs fsdp.critic_model (a model folder or name)")
            self.critic = self._shard(load_value_model(source, attn, self.options.value_head_std), trainable=True)

        total = config.run.steps * train.updates_per_step
        self.trained = [self._trained("actor", self.actor, train.lr, total)]
        if self.critic is not None:
            self.trained.append(self._trained("critic", self.critic, train.critic_lr, total))
        self.runner = PassRunner(
            kernel=self.kernel, dist=self.dist, bridge=self.bridge, packing=self.options.packing,
            token_budget=train.micro_batch_tokens, chunk=self.options.logprob_chunk_size,
            temperature=self._temperature(), backend_name=NAME,
            compile_head=self.compiled if self.options.compile_head is None else self.options.compile_head,
            attention=sdpa_preference(self.options.sdpa_backends, self.dist.device.type),
            pair_cost=attention_pair_cost(self.hf_config),
            prefix_tree=TreePolicy("off" if self.true_on_policy else self.options.prefix_tree, attn,
                                   attention_pair_cost(self.hf_config)),
            on_policy_step=self._on_policy_step,
        )
        self._rollout_weights = True  # the actor holds the weights the engines sample with (see _on_policy_step)
        self.optimizer_steps = 0
        self.skipped_steps = 0

    # ------------------------------------------------------------------ construction helpers

    def _shard(self, module: PolicyModel | ValueModel, *, trainable: bool) -> Any:
        return prepare_and_shard(
            module, mesh=self.dist.mesh, precision=self.precision, trainable=trainable,
            gradient_checkpointing=self.config.train.gradient_checkpointing,
            compile_layers=self.compiled, reshard_after_forward=self.options.reshard_after_forward,
        )

    def _trained(self, name: str, module: torch.nn.Module, lr: float, total_steps: int) -> TrainedModule:
        train = self.config.train
        fused = self.options.fused_optimizer if self.options.fused_optimizer is not None else self.dist.device.type == "cuda"
        optimizer = build_optimizer(
            module.parameters(), lr=lr, betas=train.betas, weight_decay=train.weight_decay, fused=fused,
        )
        scheduler = build_scheduler(optimizer, LRMultiplier(train.lr_schedule, train.warmup_steps, total_steps))
        # with LoRA the frozen base is re-read from its source; checkpoints hold the adapters
        return TrainedModule(name, module, optimizer, scheduler, trained_only=self.lora is not None and name == "actor")

    def _on_policy_step(self, phase: str, module: torch.nn.Module) -> int | None:
        """The RL step whose rollout sampled with exactly the weights of this actor forward, in a
        true on-policy sync run: the old-policy pass and the training forwards before the step's
        first update (``ForwardContext.state["true_on_policy_step"]``); None for any other forward."""
        if self.on_policy_check is None or module is not self.actor or phase not in ("old_logprobs", "train"):
            return None
        if not self._rollout_weights:
            return None
        return (self.optimizer_steps + self.skipped_steps) // self.config.train.updates_per_step + 1

    def _temperature(self) -> float:
        if self.options.logprob_temperature is not None:
            return self.options.logprob_temperature
        # greedy rollouts (temperature 0) are scored with the plain softmax
        return self.config.rollout.temperature or 1.0

    # ------------------------------------------------------------------ scoring

    def compute_logprobs(self, batch: TrainBatch, *, model: Literal["actor", "ref", "teacher"] = "actor") -> torch.Tensor:
        """``[B, T]`` log-probs of ``batch.tokens`` at ``loss_mask`` positions (0 elsewhere); no grad."""
        return self.compute_logprobs_and_entropy(batch, model=model, with_entropy=False)[0]

    def compute_logprobs_and_entropy(
        self, batch: TrainBatch, *, model: Literal["actor", "ref", "teacher"] = "actor", with_entropy: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``([B, T] log-probs, [B, T] entropy of the full next-token distribution or None)``."""
        if model == "ref" and self.lora is not None and self.config.train.use_reference:
            with adapters_disabled(self.actor):
                outputs = self.runner.score(_PHASES[model], self.actor, batch, with_entropy=with_entropy)
            return outputs[0], (outputs[1] if with_entropy else None)
        module = self._scoring_module(model)
        outputs = self.runner.score(_PHASES[model], module, batch, with_entropy=with_entropy)
        return outputs[0], (outputs[1] if with_entropy else None)

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, T]`` critic values ``V(tokens[:t])`` at ``loss_mask`` positions (0 elsewhere)."""
        if self.critic is None:
            raise RuntimeError("this backend has no critic: set train.use_critic: true to train one")
        return self.runner.score("values", self.critic, batch)[0]

    def _scoring_module(self, model: str) -> PolicyModel:
        modules = {"actor": self.actor, "ref": self.ref, "teacher": self.teacher}
        if model not in modules:
            raise ValueError(f"unknown model {model!r}; choose one of {', '.join(modules)}")
        module = modules[model]
        if module is None:
            switch = {"ref": "train.use_reference: true", "teacher": "train.teacher_model: <model>"}[model]
            raise RuntimeError(f"this backend has no {model} model; set {switch}")
        return module

    # ------------------------------------------------------------------ training

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """``train.updates_per_step`` optimiser steps on ``batch`` (which carries advantages):
        :func:`miles_algorithms.update.policy_update` over this backend's actor (and critic)."""
        from miles_algorithms.update import policy_update

        critic = _Trainee(self, "critic_train", self.trained[1]) if self.critic is not None else None
        check = self.on_policy_check
        logprobs: Callable[[TrainBatch], torch.Tensor] = self.compute_logprobs
        if check is not None:
            check.start_step((self.optimizer_steps + self.skipped_steps) // self.config.train.updates_per_step + 1)
            if batch.old_logprobs is not None:
                check.check(batch.old_logprobs, batch)

            def checked_logprobs(b: TrainBatch) -> torch.Tensor:
                out = self.compute_logprobs(b)
                check.check(out, b)
                return out

            logprobs = checked_logprobs

        totals = policy_update(batch, self.config, self.kernel, actor=_Trainee(self, "train", self.trained[0], check),
                               logprobs=logprobs, critic=critic, log_entropy=self.options.log_entropy)
        self._rollout_weights = True  # sync mode: the next rollout samples with the weights as they are now
        if check is not None:
            totals |= check.metrics()
        totals["optimizer_steps"] = float(self.optimizer_steps)
        totals["skipped_steps"] = float(self.skipped_steps)
        return totals

    def _apply(self, trained: TrainedModule) -> dict[str, float]:
        """Clip, step (unless the gradient is not finite), advance the schedule, clear gradients."""
        params = [p for p in trained.module.parameters() if p.requires_grad]
        total_norm = torch.nn.utils.clip_grad_norm_(params, self.config.train.grad_clip)
        norm = float(total_norm.full_tensor() if hasattr(total_norm, "full_tensor") else total_norm)
        lr = trained.optimizer.param_groups[0]["lr"]
        finite = torch.isfinite(torch.tensor(norm)).item()
        if trained.name == "actor":
            self._rollout_weights = False  # until the step ends (the engines then get these weights)
        if finite or not self.options.skip_nonfinite_grads:
            trained.optimizer.step()
            if trained.name == "actor":
                self.optimizer_steps += 1
        elif trained.name == "actor":
            self.skipped_steps += 1
        trained.scheduler.step()
        trained.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": norm, "lr": lr}

    # ------------------------------------------------------------------ weights

    def named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full actor weights with HF names, one tensor at a time (collective: iterate to the end on every rank).
        With ``train.lora``: the adapter tensors only (``...lora_A.weight``, ``...lora_B.weight``),
        which is all an engine serving the same base needs.

        :param dtype: of the yielded tensors; default the compute dtype (bf16 on CUDA, fp32 on CPU),
            which is what an engine serves.
        """
        if self.lora is not None:
            return adapter_state(self.actor.hf, dtype or self.precision.compute)
        return gather_named_weights(self.actor.hf, dtype or self.precision.compute)

    def export_hf(self, path: Path) -> None:
        """An HF folder of the actor (dtype of the source checkpoint), tokenizer files copied along.
        With ``train.lora``: the adapters merged into the base there, and the adapter alone in
        PEFT's format in ``<path>/lora_adapter`` (a subfolder: transformers would otherwise take
        the merged folder for an adapter and load it onto its base)."""
        path, dtype = Path(path), self._export_dtype()
        if self.lora is None:
            export_hf(self.actor.hf, path, source_dir=self.model_dir, dtype=dtype, dist_ctx=self.dist)
            return
        merged = merged_weights(gather_named_weights(self.actor.hf, dtype), wrapped_weight_names(self.actor.hf),
                                self.lora.scaling)
        export_hf(self.actor.hf, path, source_dir=self.model_dir, dtype=dtype, dist_ctx=self.dist, weights=merged)
        self.export_adapter(path / LORA_EXPORT_DIR)

    def export_adapter(self, path: Path) -> None:
        """The LoRA adapter in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``,
        fp32): ``peft.PeftModel.from_pretrained(base, path)`` loads it. Collective; rank 0 writes."""
        if self.lora is None:
            raise RuntimeError("this backend trains full weights; set train.lora to train (and export) an adapter")
        tensors = dict(adapter_state(self.actor.hf, torch.float32))
        if self.dist.is_main:
            base = str(self.model_dir) if self.model_dir is not None else None
            write_peft_adapter(Path(path), tensors, self.lora, base)

    def _export_dtype(self) -> torch.dtype:
        """The dtype the source checkpoint was stored in (weights are held in fp32 while training)."""
        if self.model_dir is not None and (self.model_dir / "config.json").is_file():
            stored = json.loads((self.model_dir / "config.json").read_text())
            name = stored.get("dtype") or stored.get("torch_dtype")
            if isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        return self.precision.compute

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: Path, extra_state: Mapping[str, Any]) -> None:
        save_checkpoint(Path(path), self.trained, self.optimizer_steps, extra_state, self.dist,
                        skipped_steps=self.skipped_steps)

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        self.optimizer_steps, self.skipped_steps, extra = load_checkpoint(Path(path), self.trained, self.dist)
        return extra

    def close(self) -> None:
        """Free the models and leave the process group (destroyed if this backend created it)."""
        for name in ("actor", "ref", "teacher", "critic"):
            setattr(self, name, None)
        self.trained = []
        release_distributed(self.dist)


class _Trainee:
    """One trained module of the backend as :func:`~miles_algorithms.update.policy_update` drives it."""

    def __init__(self, backend: FSDPBackend, phase: str, trained: TrainedModule,
                 check: OnPolicyCheck | None = None) -> None:
        self.backend, self.phase, self.trained, self.check = backend, phase, trained, check

    def accumulate(self, batch: TrainBatch, loss: MicroLoss, *, with_entropy: bool,
                   keep_outputs: bool) -> tuple[dict[str, float], torch.Tensor | None]:
        shares, kept = self.backend.runner.accumulate(self.phase, self.trained.module, batch, loss,
                                                      with_entropy=with_entropy, keep_outputs=keep_outputs)
        if kept is None:
            return sum_over_ranks(shares), None
        kept = all_reduce_sum(kept)
        if self.check is not None:  # the forward before this mini-batch's update: the old policy
            self.check.check(kept, batch)
        return sum_over_ranks(shares), kept

    def step(self) -> dict[str, float]:
        return self.backend._apply(self.trained)
