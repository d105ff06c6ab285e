"""Miles plugin ``algorithms``: advantage estimators, policy losses and mismatch corrections.

Registered names:

- advantages (``algorithm.advantage``): ``grpo``, ``gspo``, ``ppo``, ``reinforce_pp``,
  ``reinforce_pp_baseline``;
- policy losses (``train.policy_loss``): ``ppo_clip``, ``gspo``, ``cispo``;
- mismatch corrections (``algorithm.correction``): ``none``, ``tis``, ``mis``.

torch is imported only when a registry is collected, not when ``miles plugins`` lists plugins.
"""

from __future__ import annotations

from miles import hookimpl
from miles.registry import Register
from miles_contracts import AdvantageSpec, CorrectionSpec, PolicyLossSpec


@hookimpl
def miles_register_advantages(register: Register[AdvantageSpec]) -> None:
    from miles_algorithms.estimators import ADVANTAGES

    for name, spec in ADVANTAGES.items():
        register(name, spec)


@hookimpl
def miles_register_policy_losses(register: Register[PolicyLossSpec]) -> None:
    from miles_algorithms.losses import POLICY_LOSSES

    for name, loss in POLICY_LOSSES.items():
        register(name, PolicyLossSpec(loss))


@hookimpl
def miles_register_mismatch_corrections(register: Register[CorrectionSpec]) -> None:
    from miles_algorithms.corrections import CORRECTIONS

    for name, correction in CORRECTIONS.items():
        register(name, CorrectionSpec(correction))
