"""Miles plugin entry point of miles-engine (hook implementations live here)."""
