"""Miles plugin entry point of miles-weights (hook implementations live here)."""
