"""Miles plugin entry point of miles-router (hook implementations live here)."""
