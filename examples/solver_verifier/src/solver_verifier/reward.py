"""The ``solver_verifier`` reward: one reward per role of the episode.

It gets the episodes' primary samples (the solver's rows: ``sample.branch.role`` is
:data:`~solver_verifier.roles.SOLVER_ROLE`) with ``sample.metadata["agent_result"]`` as the program
returned it and ``sample.label`` the reference answer, and returns for each::

    {"solver": 1.0 if the solver's answer is right else 0.0,
     "verifier": 1.0 if the verdict (yes / no) says rightly whether it is, else 0.0}

The loop gives each row of the episode its role's reward (``sample.role_rewards``); an episode it
cannot score (no label, no result) is NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from miles.rewards.exact_match import exact_match_score
from miles_contracts import Sample

from solver_verifier.roles import SOLVER_ROLE, VERIFIER_ROLE


def role_rewards(sample: Sample) -> dict[str, float] | float:
    """The episode's ``{role: reward}``, or NaN when it cannot be scored."""
    result = sample.metadata.get("agent_result")
    if sample.label is None or not isinstance(result, dict) or result.get("verdict") not in ("yes", "no"):
        return math.nan
    solved = exact_match_score(str(result.get("answer") or ""), sample.label)
    judged_right = (result["verdict"] == "yes") == (solved == 1.0)
    return {SOLVER_ROLE: solved, VERIFIER_ROLE: 1.0 if judged_right else 0.0}


def solver_verifier(samples: Sequence[Sample]) -> list[dict[str, float] | float]:
    """One ``{role: reward}`` per episode (NaN for one it cannot score)."""
    return [role_rewards(s) for s in samples]
