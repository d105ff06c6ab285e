"""Rollout: turning prompt groups into scored, filtered samples (generators live in plugins)."""
