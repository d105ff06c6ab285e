"""Example episode of two roles over one policy: a solver answers, a verifier judges the answer
(:mod:`solver_verifier.agent`); one reward per role (:mod:`solver_verifier.reward`)."""
