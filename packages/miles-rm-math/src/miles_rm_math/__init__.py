"""miles-rm-math: the ``math`` reward (math-verify answer extraction and symbolic equivalence)."""

from miles_rm_math.reward import MathReward

__all__ = ["MathReward"]
