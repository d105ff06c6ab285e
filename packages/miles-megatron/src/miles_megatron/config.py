"""The ``megatron`` config section: how the model is split over ranks, and megatron-only knobs.

What both backends share (learning rate, schedule, token budget of a micro-batch, reference and
critic switches, ``gradient_checkpointing``) lives in the kernel's ``train`` section. Imports
pydantic only, so ``miles config show`` stays cheap.
"""

from __future__ import annotations

from typing import Literal

from miles_algorithms.sdpa import SdpaBackend
from pydantic import BaseModel, ConfigDict, Field, model_validator


class MegatronSection(BaseModel):
    """Options of the ``megatron`` train backend. Ranks = TP x PP x CP x DP (DP is what is left)."""

    model_config = ConfigDict(extra="forbid")

    tensor_parallel: int = Field(default=1, ge=1, description="ranks one layer's matrices are split over (TP)")
    sequence_parallel: bool = Field(
        default=True, description="with TP > 1, split norms and dropout along the sequence too (less activation memory)",
    )
    pipeline_parallel: int = Field(default=1, ge=1, description="pipeline stages (PP); layers are split evenly")
    virtual_pipeline: int | None = Field(
        default=None, ge=2, description="model chunks per pipeline rank (interleaved 1F1B); null = not interleaved",
    )
    context_parallel: int = Field(default=1, ge=1, description="ranks one sequence is split over (CP), for long contexts")
    expert_parallel: int = Field(default=1, ge=1, description="ranks the experts of an MoE layer are spread over (EP)")
    distributed_optimizer: bool = Field(default=True, description="shard optimizer state over data-parallel ranks")
    recompute: Literal["none", "selective", "full"] | None = Field(
        default=None,
        description="activation recomputation; null = 'full' when train.gradient_checkpointing, else 'none'",
    )
    moe_aux_loss_coef: float | None = Field(
        default=None, ge=0.0,
        description="router load-balancing loss weight; null = the model's (router_aux_loss_coef), 0 = off",
    )
    moe_load_balancing: Literal["aux_loss", "seq_aux_loss", "none"] = Field(
        default="aux_loss", description="megatron-core's load-balancing loss type (when the coefficient is > 0)",
    )
    transformer_impl: Literal["auto", "local", "transformer_engine"] = Field(
        default="auto",
        description="layer implementation: Transformer Engine, or megatron-core's local layers with PyTorch attention; "
                    "auto = Transformer Engine when it imports and a GPU is present",
    )
    logprob_chunk_size: int = Field(
        default=1024, ge=1, description="positions per log-prob chunk; peak logits memory is chunk x vocab/TP",
    )
    logprob_temperature: float | None = Field(
        default=None, gt=0.0, description="divide logits by this before log-softmax; null = rollout.temperature",
    )
    log_entropy: bool = Field(default=True, description="report the policy entropy every step")
    compile: bool | None = Field(
        default=None,
        description="torch.compile the log-prob head's per-chunk maths and, with the local layers, the rotary "
                    "embedding (and the whole layers: compile_layers); null = on for CUDA (on the H200 head and "
                    "rotary 1.56x / 1.18x the eager step at 4K / 16K rows, compiled layers 1.14x / 1.08x more: "
                    "docs/benchmarks/train.md)",
    )
    compile_layers: bool | None = Field(
        default=None,
        description="with the local layers and no recomputation, torch.compile each dense transformer layer too "
                    "(norms, rotary embedding, residual adds fused; core attention and MoE layers stay eager); "
                    "null = same as compile",
    )
    attention_kernel: Literal["sdpa", "varlen"] = Field(
        default="sdpa",
        description="local layers' attention: sdpa = PyTorch SDPA per packed sequence; varlen = one "
                    "torch.nn.attention.varlen call per layer for all sequences (CUDA, torch >= 2.10; slower "
                    "than sdpa on the H200 at 4K-16K rows, docs/benchmarks/train.md); context parallelism and "
                    "dropout use sdpa",
    )
    sdpa_backends: list[SdpaBackend] | None = Field(
        default=None,
        description="local layers' PyTorch attention kernels in order of preference; null = cudnn, flash, efficient, "
                    "math on CUDA, PyTorch's own on CPU; [] = PyTorch's own (its order moves: with Transformer "
                    "Engine imported it ran flash-attention 2, 1.3x slower steps at 16K rows on the H200)",
    )
    skip_nonfinite_grads: bool = Field(
        default=True, description="skip an optimizer step whose gradient norm is NaN/inf (counted in metrics; the "
                                  "learning-rate schedule still advances)",
    )
    grad_reduce_in_fp32: bool = Field(default=True, description="accumulate and reduce gradients in fp32 under bf16")
    overlap_grad_reduce: bool = Field(default=False, description="overlap the data-parallel gradient reduction with backward")
    vocab_multiple: int = Field(
        default=1, ge=1, description="pad the vocabulary to a multiple of this x TP (padded rows never get probability)",
    )

    @model_validator(mode="after")
    def _interleaving_needs_pipeline(self) -> MegatronSection:
        if self.virtual_pipeline is not None and self.pipeline_parallel < 2:
            raise ValueError("megatron.virtual_pipeline needs megatron.pipeline_parallel >= 2")
        return self

    @property
    def model_parallel(self) -> int:
        """Ranks one model replica spans (without experts): TP x PP x CP."""
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel
