"""Miles plugin entry point of miles-tito (hook implementations live here)."""
