"""`AlgorithmParams`: the ``algorithm`` config section, shared by the config and algorithm plugins.

It lives in the contracts because advantage estimators, policy losses and mismatch corrections
from any package read it. A plugin needing parameters of its own registers a config section.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
LossReduction = Literal["token_mean", "sequence_mean", "sequence_mean_token_sum"]
CorrectionLevel = Literal["token", "sequence", "geometric"]


class AlgorithmParams(BaseModel):
    """RL algorithm hyper-parameters (one step's advantage and loss)."""

    model_config = ConfigDict(extra="forbid")

    advantage: str = Field(default="grpo", description="registered advantage estimator name")
    normalize_std: bool = Field(default=True, description="divide group-centred rewards by group std (GRPO); false = Dr.GRPO")
    gamma: float = Field(default=1.0, ge=0.0, le=1.0, description="discount (PPO/GAE, REINFORCE++)")
    lam: float = Field(default=1.0, ge=0.0, le=1.0, description="GAE lambda")
    kl_coef: float = Field(default=0.0, ge=0.0, description="KL penalty folded into the reward")
    kl_estimator: KLEstimator = "k1"
    kl_loss_coef: float = Field(default=0.0, ge=0.0, description="KL(actor || ref) added to the loss")
    kl_loss_estimator: KLEstimator = "low_var_kl"
    entropy_coef: float = Field(default=0.0, description="entropy bonus coefficient")
    eps_clip: float = Field(default=0.2, gt=0.0)
    eps_clip_high: float | None = Field(default=None, gt=0.0, description="upper clip; defaults to eps_clip")
    dual_clip_c: float | None = Field(default=None, gt=1.0, description="dual-clip bound c > 1 for negative advantages")
    cispo_eps_low: float = Field(
        default=1.0, ge=0.0, le=1.0,
        description="cispo: the IS weight's floor is 1 - cispo_eps_low (1.0: no floor, as in MiniMax-M1)",
    )
    cispo_eps_high: float = Field(default=0.28, gt=0.0, description="cispo: the IS weight's cap is 1 + cispo_eps_high")
    value_clip: float = Field(default=0.2, gt=0.0)
    value_loss_coef: float = Field(default=0.5, ge=0.0)
    loss_reduction: LossReduction = "token_mean"
    correction: str = Field(default="none", description="registered mismatch correction (none, tis, mis)")
    correction_level: CorrectionLevel = "token"
    correction_low: float = Field(default=0.0, ge=0.0)
    correction_high: float = Field(default=2.0, gt=0.0)
    opd_coef: float = Field(default=0.0, ge=0.0, description="on-policy distillation: weight of (teacher - student) log-prob")
    normalize_advantages: bool = Field(
        default=False,
        description="whiten advantages over the batch's trainable tokens (mean 0, std 1) after any estimator",
    )

    @model_validator(mode="after")
    def _check(self) -> AlgorithmParams:
        if self.correction_low >= self.correction_high:
            raise ValueError(
                f"correction_low ({self.correction_low}) must be below correction_high ({self.correction_high})"
            )
        return self

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high
