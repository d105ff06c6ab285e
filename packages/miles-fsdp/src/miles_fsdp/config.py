"""The ``fsdp`` config section: options only this backend has.

Everything a second backend would share (learning rate, schedule, micro-batch token budget,
reference/critic switches) lives in the kernel's ``train`` section; this section holds the FSDP2
knobs. Imports pydantic only, so ``miles config show`` stays cheap.
"""

from __future__ import annotations

from typing import Literal

from miles_algorithms.sdpa import SdpaBackend
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# attention implementations that take an arbitrary mask (flash-attention kernels take none);
# here, not in prefix_tree, so reading the config never imports torch
TREE_ATTENTION = ("sdpa", "flex_attention")


class FSDPSection(BaseModel):
    """Options of the ``fsdp`` train backend."""

    model_config = ConfigDict(extra="forbid")

    packing: bool = Field(
        default=True,
        description="pack the rows of a micro-batch into one sequence (no padding); false = padded [b, t] rows",
    )
    logprob_chunk_size: int = Field(
        default=1024, ge=1,
        description="response positions per log-prob chunk; peak logits memory is chunk x vocab, never B x T x vocab",
    )
    logprob_temperature: float | None = Field(
        default=None, gt=0.0,
        description="divide logits by this before log-softmax; null = rollout.temperature (1.0 when that is 0)",
    )
    log_entropy: bool = Field(
        default=True, description="report the policy entropy every step (its gradient is computed only if entropy_coef != 0)",
    )
    reshard_after_forward: bool = Field(
        default=True, description="free gathered layer weights after forward (less memory, one more all-gather)",
    )
    attn_implementation: str = Field(
        default="sdpa", description="transformers attention implementation (flex_attention: block-sparse prefix trees)",
    )
    prefix_tree: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="run the rows of a micro-batch that share a prefix (a GRPO group's prompt, an episode's "
                    "branches) as one tree, the prefix computed once: auto = when the cost model says it is 10% "
                    "cheaper (needs attn_implementation sdpa or flex_attention), on = always, off = never",
    )
    compile: bool | None = Field(
        default=None,
        description="torch.compile each decoder layer; null = on for CUDA (about 2x the eager step, see "
                    "docs/benchmarks/train.md), off on CPU",
    )
    compile_head: bool | None = Field(
        default=None, description="torch.compile the chunked log-prob head's per-chunk maths; null = same as compile",
    )
    sdpa_backends: list[SdpaBackend] | None = Field(
        default=None,
        description="scaled-dot-product attention kernels in order of preference (e.g. [cudnn, flash]); "
                    "null = cudnn, flash, efficient, math on CUDA (PyTorch's own order is process-wide and "
                    "moves with what is imported), PyTorch's own on CPU; [] = PyTorch's own",
    )
    fused_optimizer: bool | None = Field(default=None, description="fused AdamW; null = on for CUDA, off for CPU")
    critic_model: str | None = Field(
        default=None, description="critic initialisation: a model folder or a name a plugin resolves (as model.name); "
                                  "null = model.name",
    )
    value_head_std: float = Field(default=0.0, ge=0.0, description="init std of the critic's value head (0 = zeros)")
    skip_nonfinite_grads: bool = Field(
        default=True, description="skip an optimiser step whose gradient norm is NaN/inf (counted in metrics)",
    )
    reduce_dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="dtype of gradient reduce-scatter under bf16 compute",
    )

    @field_validator("prefix_tree", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: object) -> object:
        # YAML 1.1 reads a bare on/off as a boolean: `prefix_tree: on` means "on", not True
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _tree_needs_a_masked_attention(self) -> FSDPSection:
        if self.prefix_tree == "on" and self.attn_implementation not in TREE_ATTENTION:
            raise ValueError(
                f"fsdp.prefix_tree: on needs fsdp.attn_implementation in {list(TREE_ATTENTION)} (a kernel that takes "
                f"a tree mask), got {self.attn_implementation!r}; set one of those or fsdp.prefix_tree: auto/off"
            )
        return self
