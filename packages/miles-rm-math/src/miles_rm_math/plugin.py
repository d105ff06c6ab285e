"""Miles plugin ``rm_math``: registers the ``math`` reward (math-verify in worker processes).

Light on purpose: math-verify and sympy are imported only inside the worker processes.
"""

from __future__ import annotations

from miles import hookimpl
from miles.registry import Register
from miles_contracts import RewardSpec

from miles_rm_math.reward import MathReward


@hookimpl
def miles_register_rewards(register: Register[RewardSpec]) -> None:
    reward = MathReward()  # bound to reward.timeout by the run
    register("math", RewardSpec(reward, bind=reward.bind))
