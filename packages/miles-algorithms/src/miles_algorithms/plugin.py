"""Miles plugin ``algorithms``: advantage estimators, policy losses and mismatch corrections.

Registered names:

- advantages (``algorithm.advantage``): ``grpo``, ``gspo``, ``ppo``, ``reinforce_pp``,
  ``reinforce_pp_baseline``;
- policy losses (``train.policy_loss``): ``ppo_clip``, ``gspo``, ``cispo``;
- mismatch corrections (``algorithm.correction``): ``none``, ``tis``, ``mis``.

Registering imports no torch (:mod:`miles_algorithms.catalog`): validating a config collects these
registries, and ``miles config show`` should not wait for torch. An implementation imports it at
its first call.
"""

from __future__ import annotations

from miles import hookimpl
from miles.registry import Register
from miles_contracts import AdvantageSpec, CorrectionSpec, PolicyLossSpec

from miles_algorithms.catalog import ADVANTAGE_SPECS, CORRECTION_SPECS, POLICY_LOSS_SPECS


@hookimpl
def miles_register_advantages(register: Register[AdvantageSpec]) -> None:
    for name, spec in ADVANTAGE_SPECS.items():
        register(name, spec)


@hookimpl
def miles_register_policy_losses(register: Register[PolicyLossSpec]) -> None:
    for name, spec in POLICY_LOSS_SPECS.items():
        register(name, spec)


@hookimpl
def miles_register_mismatch_corrections(register: Register[CorrectionSpec]) -> None:
    for name, spec in CORRECTION_SPECS.items():
        register(name, spec)
