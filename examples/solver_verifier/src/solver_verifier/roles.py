"""The two roles of the episode (a module of its own: the reward reads them without importing the
agent, whose HTTP clients a command that only lists plugins must not load)."""

SOLVER_ROLE = "solver"  # the first session's role: config.yaml sets tito.agent_role to it
VERIFIER_ROLE = "verifier"
