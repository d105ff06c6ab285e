"""verifiers environments in Miles."""
