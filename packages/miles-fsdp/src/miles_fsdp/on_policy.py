"""The true on-policy run-time check (``rollout.true_on_policy_check``), in the trainer process.

With ``rollout.true_on_policy`` in sync mode the trainer's log-prob of every trainable token must
equal the engine's bit for bit (both sides run :mod:`miles_engine.invariant`). Every time the
trainer computes the actor's log-probs of a step's batch without a weight update in between (the
old-policy pass, or the first mini-batch's forward that stands in for it), :meth:`OnPolicyCheck.check`
compares them with the rollout's. ``error``: the first differing token fails the step, named by
step, sample and position; ``metric``: differing tokens are counted and logged as
``train/true_on_policy_mismatched_tokens`` (with ``train/true_on_policy_checked_tokens``).

Only sync mode is checked: in one_step_off and fully_async the rollout's log-probs come from an
older weight version by design. With ``train.reuse_rollout_logprobs`` no old-policy pass runs and
the batch carries no ``old_logprobs`` here (``policy_update`` puts the rollout's in place), so the
check sees the first mini-batch's forward only: every token with one update per step, that
mini-batch's share with several.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from miles_contracts import TrainBatch

if TYPE_CHECKING:
    from miles_fsdp.config import FSDPSection


def incompatible_options(options: FSDPSection, *, rollout_temperature: float) -> list[str]:
    """``fsdp`` settings that would break the invariant forward, each with its fix."""
    errors = []
    sampled_with = rollout_temperature or 1.0  # a greedy rollout reports the plain softmax's log-probs
    if options.logprob_temperature is not None and options.logprob_temperature != sampled_with:
        errors.append(f"fsdp.logprob_temperature ({options.logprob_temperature}) scores tokens at another temperature "
                      f"than the engine sampled them with ({sampled_with}); leave it unset (null) with "
                      f"rollout.true_on_policy")
    if options.compile or options.compile_head:
        errors.append("fsdp.compile / fsdp.compile_head: torch.compile fuses and reorders the reductions; "
                      "leave them unset (off) with rollout.true_on_policy")
    if options.prefix_tree == "on":
        errors.append("fsdp.prefix_tree: on runs shared prefixes once under a tree mask, which the invariant "
                      "attention is not tested with; set fsdp.prefix_tree: auto or off (off is used)")
    return errors


class OnPolicyMismatch(RuntimeError):
    """A true on-policy run computed a trainer log-prob that differs from the rollout's."""


@dataclass(slots=True)
class OnPolicyCheck:
    mode: Literal["error", "metric"]
    step: int = 0  # the RL step being trained (set by the backend before each train_step)
    checked: int = 0
    mismatched: int = 0

    def check(self, logprobs: torch.Tensor, batch: TrainBatch) -> None:
        """Compare ``[B, T]`` trainer log-probs with ``batch.rollout_logprobs`` on trainable tokens."""
        mask = batch.loss_mask.to(logprobs.device) > 0
        rollout = batch.rollout_logprobs.to(logprobs.device).float()
        differs = mask & (logprobs.float() != rollout)
        self.checked += int(mask.sum())
        count = int(differs.sum())
        self.mismatched += count
        if count and self.mode == "error":
            row, col = (int(i) for i in differs.nonzero()[0])
            first_response = int(mask[row].nonzero()[0, 0])
            raise OnPolicyMismatch(
                f"true on-policy check: step {self.step}, sample {int(batch.rollout_ids[row])} (batch row {row}), "
                f"response token {col - first_response} (column {col}, token id {int(batch.tokens[row, col])}): "
                f"trainer log-prob {float(logprobs[row, col])!r} != rollout log-prob {float(rollout[row, col])!r}; "
                f"{count} of {int(mask.sum())} tokens differ. Set rollout.true_on_policy_check: metric to count them "
                f"instead of failing"
            )

    def metrics(self) -> dict[str, float]:
        return {"true_on_policy_checked_tokens": float(self.checked),
                "true_on_policy_mismatched_tokens": float(self.mismatched)}

    def start_step(self, step: int) -> None:
        self.step, self.checked, self.mismatched = step, 0, 0
