"""The RL loop behind ``miles train``: services, rollout, learner, checkpoints, progress."""
