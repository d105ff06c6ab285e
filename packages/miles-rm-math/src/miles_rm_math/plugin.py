"""Miles plugin entry point of miles-rm-math (hook implementations live here)."""
