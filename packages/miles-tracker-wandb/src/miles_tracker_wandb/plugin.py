"""Miles plugin entry point of miles-tracker-wandb (hook implementations live here)."""
