"""OpenEnv environments in Miles."""
