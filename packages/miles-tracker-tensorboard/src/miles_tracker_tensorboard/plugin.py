"""Miles plugin entry point of miles-tracker-tensorboard (hook implementations live here)."""
