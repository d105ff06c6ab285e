"""The LoRA settings a run trains with, shared by train backends and engines.

A trainer and the engines it syncs to must agree on where adapters sit and how they are scaled,
so both read this one model (``train.lora`` in a run's config; engines receive it with their
settings). Pydantic only: importing it costs nothing.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

# the attention and MLP projections of Llama / Qwen / Mistral style decoders
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class LoRASpec(BaseModel):
    """Low-rank adapters ``W x + (alpha / rank) * B A x`` on the named linear layers.

    ``A`` (``[rank, in]``) starts random (Kaiming uniform, as PEFT) and ``B`` (``[out, rank]``)
    at zero, so training starts from the base model exactly.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(default=16, ge=1, le=4096, description="rank r of each adapter (A: [r, in], B: [out, r])")
    alpha: float = Field(default=32.0, gt=0, description="scale numerator: the update is multiplied by alpha / rank")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="dropout on the adapter's input while training")
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_TARGET_MODULES),
        description="leaf names of the nn.Linear layers that get adapters (e.g. q_proj, down_proj); "
                    "every name must match at least one layer of the model",
    )

    @field_validator("target_modules")
    @classmethod
    def _plain_names(cls, names: list[str]) -> list[str]:
        if not names:
            raise ValueError("target_modules is empty; name at least one linear layer, e.g. [q_proj, v_proj]")
        bad = [n for n in names if not _MODULE_NAME.match(n)]
        if bad:
            raise ValueError(f"target_modules must be leaf module names such as q_proj (no dots or patterns), got {bad}")
        if len(set(names)) != len(names):
            raise ValueError(f"target_modules lists a name twice: {names}")
        return names

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank
