"""Miles plugin ``algorithms``: advantage estimators, policy losses and mismatch corrections.

Registered names:

- advantages (``algorithm.advantage``): ``grpo``, ``gspo``, ``ppo``, ``reinforce_pp``,
  ``reinforce_pp_baseline``;
- policy losses (``train.policy_loss``): ``ppo_clip``, ``gspo``;
- mismatch corrections (``algorithm.correction``): ``none``, ``tis``, ``mis``.

torch is imported only when a registry is collected, not when ``miles plugins`` lists plugins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles import hookimpl
from miles.errors import ConfigError
from miles.registry import Register

if TYPE_CHECKING:
    from miles.config import MilesConfig


@hookimpl
def miles_register_advantages(register: Register) -> None:
    from miles_algorithms.estimators import ESTIMATORS
    from miles_algorithms.objective import CompleteEstimator

    for name, estimator in ESTIMATORS.items():
        register(name, CompleteEstimator(estimator))


@hookimpl
def miles_register_policy_losses(register: Register) -> None:
    from miles_algorithms.losses import POLICY_LOSSES

    for name, loss in POLICY_LOSSES.items():
        register(name, loss)


@hookimpl
def miles_register_mismatch_corrections(register: Register) -> None:
    from miles_algorithms.corrections import CORRECTIONS

    for name, correction in CORRECTIONS.items():
        register(name, correction)


@hookimpl
def miles_configure(config: MilesConfig) -> None:
    # GSPO is the gspo estimator's advantages *and* the gspo loss's sequence-level ratio; with the
    # token-level ppo_clip loss it would silently be GRPO, so the pairing is checked up front.
    if config.algorithm.advantage == "gspo" and config.train.policy_loss != "gspo":
        raise ConfigError([
            f"algorithm.advantage 'gspo' needs train.policy_loss: gspo (the sequence-level ratio), got "
            f"{config.train.policy_loss!r}; for token-level ratios use algorithm.advantage: grpo"
        ])
