"""`MegatronBackend`: the ``megatron`` train backend (megatron-core; TP, PP, CP, EP, DP).

SPMD contract (as for every Miles backend): with several ranks, every rank constructs the backend
and calls every method with the same arguments (the full batch, the same paths); the backend
splits the work and every rank gets the full result back. ``named_weights()`` is collective:
every rank iterates it to the end; rank 0 yields the full HF tensors, other ranks nothing.

The model comes from the model bridge that claims the checkpoint's ``config.json``: its
``megatron_config()`` describes the ``GPTModel``, ``to_megatron`` / ``to_hf`` move weights in and
out. One ``train_step`` is ``train.updates_per_step`` optimizer steps, each on a mini-batch that
went through ``miles_algorithms.objective.prepare_batch``, exactly as in the FSDP backend.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch
from miles.trainer.collectives import sum_over_ranks
from miles.trainer.device import pick_device
from miles_algorithms.sdpa import sdpa_preference
from miles_engine.lora import switched_off, write_peft_adapter

from miles_megatron import checkpoint, lora, parallel
from miles_megatron.config import MegatronSection
from miles_megatron.cpu_shim import cpu_megatron
from miles_megatron.loading import weight_source
from miles_megatron.model import (
    ModelParts,
    build_chunks,
    padded_vocab_size,
    set_learning_rate,
    transformer_config,
    wrap_and_optimize,
)
from miles_megatron.passes import PassRunner
from miles_megatron.spec import use_transformer_engine
from miles_megatron.weights import WeightGather, describe_shards

if TYPE_CHECKING:
    from miles.config import MilesConfig
    from miles_algorithms.update import MicroLoss
    from miles_contracts import RunContext, TrainBatch

NAME = "megatron"
F = TypeVar("F", bound=Callable[..., Any])
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def _on_megatron(method: F) -> F:
    """Run a method with megatron-core's CPU replacements active (a no-op on GPU)."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with cpu_megatron():
            return method(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


class MegatronBackend:
    """Actor (and optional frozen reference) as megatron-core ``GPTModel`` chunks; a ``TrainBackend``.

    :param ctx: the run as this process sees it: ``ctx.config`` (``model``, ``train``,
        ``algorithm``, ``rollout.temperature``, ``run``, and the ``megatron`` section are read) and
        ``ctx.kernel``, whose plugins resolve the model name, claim the model (its bridge), wrap
        forwards and provide the policy loss and mismatch correction.
    :param hf_state / hf_config: weights and ``config.json`` to train instead of loading
        ``config.model.name`` (benchmarks: a random model built in memory).
    """

    @_on_megatron
    def __init__(self, ctx: RunContext, *, hf_state: Mapping[str, torch.Tensor] | None = None,
                 hf_config: Mapping[str, Any] | None = None) -> None:
        self.config = config = ctx.config
        self.kernel = ctx.kernel
        self.options = config.section(NAME, MegatronSection)
        train = config.train
        switches = (("train.use_critic", train.use_critic), ("train.teacher_model", train.teacher_model))
        unsupported = [s for s, on in switches if on]
        if unsupported:
            raise ValueError(f"the megatron backend does not support {', '.join(unsupported)} yet; use train.backend: fsdp")
        self.device = pick_device(config.model.device)
        self.layout, self.ranks = parallel.setup(self.options, self.device, config.run.seed)
        try:
            self._build(config, hf_state, hf_config)
        except BaseException:
            parallel.release()
            raise

    def _build(self, config: MilesConfig, hf_state: Mapping[str, torch.Tensor] | None, hf_config: Mapping[str, Any] | None) -> None:
        self.model_dir: Path | None = None
        if hf_state is None:
            self.model_dir = Path(self.kernel.resolve_model(config.model.name))
            hf_config = json.loads((self.model_dir / "config.json").read_text())
        if hf_config is None:
            raise ValueError("hf_state needs its hf_config (the model's config.json as a mapping)")
        self.hf_config = dict(hf_config)
        self.bridge = self.kernel.model_bridge(self.hf_config)  # a clear error naming the installed bridges
        megatron_config = self.bridge.megatron_config(self.hf_config)
        name = config.model.dtype if config.model.dtype != "auto" else ("bfloat16" if self.device.type == "cuda" else "float32")
        self.dtype = getattr(torch, name)
        lora_spec = config.train.lora
        if lora_spec is not None and self.options.transformer_impl == "transformer_engine":
            # its linear_qkv / linear_fc1 apply the layer norm inside: the adapters would see pre-norm inputs
            raise ValueError("train.lora with the megatron backend runs its local layers: set megatron.transformer_impl: "
                             "local or auto (Transformer Engine fuses the norm into the linears that carry adapters)")
        # auto: Transformer Engine where it imports on a GPU, the local layers under LoRA
        impl = "local" if lora_spec is not None else self.options.transformer_impl
        self.transformer_engine = use_transformer_engine(impl, self.device)
        self.compiled = self.options.compile if self.options.compile is not None else self.device.type == "cuda"
        varlen = self.options.attention_kernel == "varlen"
        if varlen:
            from miles_megatron.attention import varlen_problem

            if self.transformer_engine:
                raise ValueError("megatron.attention_kernel applies to the local layers; Transformer Engine brings its own")
            problem = varlen_problem() if self.device.type == "cuda" else "it needs model.device: cuda"
            if problem:
                raise ValueError(f"megatron.attention_kernel: varlen cannot run: {problem}; use attention_kernel: sdpa")
        recompute = self.options.recompute or ("full" if config.train.gradient_checkpointing else "none")
        layers = self.options.compile_layers
        # recomputation runs layer pieces under megatron-core's checkpoint function: left eager
        # LoRA's forward hooks run megatron-core's autograd collectives: those layers stay eager
        compile_layers = (self.compiled if layers is None else layers) and not self.transformer_engine and recompute == "none" \
            and config.train.lora is None
        tc = transformer_config(megatron_config, self.options, self.layout, dtype=self.dtype, device=self.device,
                                transformer_engine=self.transformer_engine, recompute=recompute)
        vocab = int(megatron_config["gpt_model"]["vocab_size"])
        padded = padded_vocab_size(vocab, self.options, self.layout)
        source = weight_source(self.bridge, self.hf_config, model_dir=self.model_dir, hf_state=hf_state)
        self.bridge_names = source.names

        def new_chunks() -> list[Any]:
            return build_chunks(megatron_config, tc, self.layout, padded, transformer_engine=self.transformer_engine,
                                device=self.device, compiled=self.compiled, compile_layers=compile_layers, varlen=varlen,
                                sdpa=sdpa_preference(self.options.sdpa_backends, self.device.type))

        chunks = new_chunks()
        shards = describe_shards(chunks, tc, self.bridge_names)
        source.load(shards, padded)
        source.release()
        self.layers_read = source.layers_read  # streamed: the checkpoint layers this rank read (None: the rest)
        train = config.train
        self.adapters: list[lora.LinearAdapters] = []
        if train.lora is not None:
            # only the adapters train; the KL reference is the actor with them off (no second model)
            self.adapters = lora.attach(chunks, tc, train.lora, config.run.seed)
            lora.check_targets_found(self.adapters, train.lora)
        ref_chunks = None
        if train.use_reference and train.lora is None:
            # the reference starts as the actor: copied from it, not read from the checkpoint again
            ref_chunks = new_chunks()
            for ref, actor in zip(ref_chunks, chunks, strict=True):
                ref.load_state_dict(actor.state_dict())
        wrapped, optimizer = wrap_and_optimize(chunks, tc, self.options, lr=train.lr, betas=train.betas,
                                               weight_decay=train.weight_decay, grad_clip=train.grad_clip)
        self.actor = ModelParts(chunks, wrapped, optimizer, tc, vocab, padded)
        self.ref: ModelParts | None = None
        if ref_chunks is not None:
            for chunk in ref_chunks:
                chunk.requires_grad_(False)
                if self.dtype != torch.float32:
                    chunk.to(self.dtype)
            self.ref = ModelParts(ref_chunks, ref_chunks, None, tc, vocab, padded)
        self.gather = WeightGather(shards, self.bridge_names, self.bridge, self.hf_config, vocab)
        # what trains and syncs: every weight, or (LoRA) the adapters under their PEFT names
        self.trained = self.gather
        if self.adapters:
            adapter_shards = lora.adapter_shards(self.adapters)
            self.trained = WeightGather(adapter_shards, lora.adapter_order(adapter_shards), lora.NamesAsTheyAre(),
                                        self.hf_config, vocab)
        from miles_algorithms.schedule import LRMultiplier

        self.schedule = LRMultiplier(train.lr_schedule, train.warmup_steps, config.run.steps * train.updates_per_step)
        self.optimizer_steps = 0
        self.skipped_steps = 0

    def _runner(self, parts: ModelParts) -> PassRunner:
        return PassRunner(kernel=self.kernel, parts=parts, layout=self.layout, bridge=self.bridge,
                          token_budget=self.config.train.micro_batch_tokens, chunk=self.options.logprob_chunk_size,
                          temperature=self._temperature(), device=self.device, backend_name=NAME,
                          compiled=self.compiled)

    def _temperature(self) -> float:
        if self.options.logprob_temperature is not None:
            return self.options.logprob_temperature
        return self.config.rollout.temperature or 1.0  # greedy rollouts are scored with the plain softmax

    # ------------------------------------------------------------------ scoring

    def compute_logprobs(self, batch: TrainBatch, *, model: Literal["actor", "ref", "teacher"] = "actor") -> torch.Tensor:
        """``[B, T]`` log-probs of ``batch.tokens`` at ``loss_mask`` positions (0 elsewhere); no grad."""
        return self.compute_logprobs_and_entropy(batch, model=model, with_entropy=False)[0]

    @_on_megatron
    def compute_logprobs_and_entropy(self, batch: TrainBatch, *, model: Literal["actor", "ref", "teacher"] = "actor",
                                     with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        phases = {"actor": ("old_logprobs", self.actor), "ref": ("ref_logprobs", self.ref)}
        if model not in phases:
            raise ValueError(f"the megatron backend scores 'actor' and 'ref' models, not {model!r}")
        phase, parts = phases[model]
        if model == "ref" and self.adapters and self.config.train.use_reference:
            with switched_off(self.adapters):
                outputs = self._runner(self.actor).score(phase, batch, with_entropy=with_entropy)
            return outputs[0], (outputs[1] if with_entropy else None)
        if parts is None:
            raise RuntimeError("this backend has no ref model; set train.use_reference: true")
        outputs = self._runner(parts).score(phase, batch, with_entropy=with_entropy)
        return outputs[0], (outputs[1] if with_entropy else None)

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        raise RuntimeError("the megatron backend has no critic yet; use train.backend: fsdp for PPO with a critic")

    # ------------------------------------------------------------------ training

    @_on_megatron
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """``train.updates_per_step`` optimizer steps on ``batch`` (which carries advantages):
        :func:`miles_algorithms.update.policy_update` over the actor's chunks."""
        from miles_algorithms.update import policy_update

        totals = policy_update(batch, self.config, self.kernel, actor=_Trainee(self, self._runner(self.actor)),
                               logprobs=self.compute_logprobs, log_entropy=self.options.log_entropy)
        totals["optimizer_steps"] = float(self.optimizer_steps)
        totals["skipped_steps"] = float(self.skipped_steps)
        return totals

    def _apply(self) -> dict[str, float]:
        """Clip, step, zero the gradient buffers; the learning rate follows the schedule."""
        lr = self.config.train.lr * self.schedule(self.optimizer_steps + self.skipped_steps)
        optimizer = self.actor.optimizer
        set_learning_rate(optimizer, lr)
        # fp16 has megatron-core's loss scaler, which skips an overflowing step itself (and must
        # see each step's gradients once: it adjusts the scale every time it looks)
        check = self.options.skip_nonfinite_grads and self.dtype != torch.float16
        norm = self._nonfinite_grad_norm() if check else None
        if norm is not None:
            success, grad_norm = False, norm
        else:
            success, grad_norm, _ = optimizer.step()
        if success:
            self.optimizer_steps += 1
        else:
            self.skipped_steps += 1
        for chunk in self.actor.wrapped:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        return {"grad_norm": float(grad_norm) if grad_norm is not None else float("nan"), "lr": lr}

    def _nonfinite_grad_norm(self) -> float | None:
        """The gradient norm if it is NaN/inf (on any rank: megatron reduces it over the model- and
        data-parallel groups that hold the gradients), else None. megatron-core only skips a step
        on an overflow its fp16 loss scaler finds; under bf16 and fp32 it would apply the NaN.
        ``prepare_grads`` copies the gradients to where the optimizer reads them; the ``step()``
        that follows a finite norm does it again (a copy, not an accumulation)."""
        optimizer = self.actor.optimizer
        optimizer.prepare_grads()
        norm = float(optimizer.get_grad_norm())
        return None if math.isfinite(norm) else norm

    # ------------------------------------------------------------------ weights

    def named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full actor weights with HF names on rank 0 (collective: iterate to the end on every rank);
        with ``train.lora`` the adapters only, under the names the fsdp backend gives them.

        :param dtype: of the yielded tensors; default the compute dtype (what an engine serves).
        """
        return self.trained.gather(dtype or self.dtype, self.device)

    def export_hf(self, path: Path) -> None:
        """An HF folder of the actor (dtype of the source checkpoint), tokenizer files copied along;
        with ``train.lora`` the merged model (``W + (alpha/r) B A``) and the PEFT adapter in
        ``path/lora_adapter/``, as the fsdp backend writes them."""
        from safetensors.torch import save_file

        path = Path(path)
        dtype = self._export_dtype()
        spec = self.config.train.lora
        adapters: dict[str, torch.Tensor] = {}
        if spec is not None:
            adapters = {name: t.cpu() for name, t in self.trained.gather(torch.float32, self.device)}
            tensors = dict(lora.merged(self.gather.gather(None, self.device), adapters, spec, dtype))
        else:
            tensors = {name: t.cpu() for name, t in self.gather.gather(dtype, self.device)}
        if self.ranks.is_main:
            path.mkdir(parents=True, exist_ok=True)
            for old in path.iterdir():
                if old.name.endswith(_WEIGHT_SUFFIXES):
                    old.unlink()
            save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
            if self.model_dir is not None:
                for item in self.model_dir.iterdir():
                    if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES) and item.name != "config.json":
                        shutil.copy2(item, path / item.name)
            (path / "config.json").write_text(json.dumps({**self.hf_config, "dtype": str(dtype).removeprefix("torch.")}, indent=2) + "\n")
            if spec is not None:  # a subfolder: transformers would load a folder holding adapter_config.json as an adapter
                write_peft_adapter(path / "lora_adapter", adapters, spec, self.config.model.name)
        parallel.barrier()

    def _export_dtype(self) -> torch.dtype:
        name = self.hf_config.get("dtype") or self.hf_config.get("torch_dtype")
        found = getattr(torch, name, None) if isinstance(name, str) else None
        return found if isinstance(found, torch.dtype) else self.dtype

    # ------------------------------------------------------------------ checkpoints

    @_on_megatron
    def save_checkpoint(self, path: Path, extra_state: Mapping[str, Any]) -> None:
        checkpoint.save(Path(path), self.actor.chunks, self.actor.optimizer, self.optimizer_steps, self.layout,
                        extra_state, self.ranks, skipped_steps=self.skipped_steps, keep=self._checkpointed)

    @_on_megatron
    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        self.optimizer_steps, self.skipped_steps, extra = checkpoint.load(Path(path), self.actor.chunks,
                                                                          self.actor.optimizer, self.ranks,
                                                                          keep=self._checkpointed)
        return extra

    @property
    def _checkpointed(self) -> Callable[[str], bool] | None:
        """Which model keys a checkpoint holds: all, or (LoRA) the adapters; the base is re-read
        from ``model.name`` when a run resumes."""
        return lora.is_adapter_key if self.adapters else None

    def close(self) -> None:
        """Free the models and leave the parallel state (torn down by the last backend of the process)."""
        if getattr(self, "actor", None) is None:
            return
        from megatron.core.transformer.moe.router_replay import RouterReplay

        mine = {id(m.router_replay) for parts in (self.actor, self.ref) if parts for c in parts.chunks
                for m in c.modules() if getattr(m, "router_replay", None) is not None}
        RouterReplay.global_router_replay_instances[:] = [
            r for r in RouterReplay.global_router_replay_instances if id(r) not in mine]
        del self.actor  # the models are freed; a second close finds no actor
        self.ref = None
        parallel.release()


class _Trainee:
    """The actor's chunks as :func:`~miles_algorithms.update.policy_update` drives them."""

    def __init__(self, backend: MegatronBackend, runner: PassRunner) -> None:
        self.backend, self.runner = backend, runner

    def accumulate(self, batch: TrainBatch, loss: MicroLoss, *, with_entropy: bool,
                   keep_outputs: bool) -> tuple[dict[str, float], torch.Tensor | None]:
        shares, kept = self.runner.accumulate("train", batch, loss, with_entropy=with_entropy, keep_outputs=keep_outputs)
        return sum_over_ranks(shares), kept

    def step(self) -> dict[str, float]:
        return self.backend._apply()
