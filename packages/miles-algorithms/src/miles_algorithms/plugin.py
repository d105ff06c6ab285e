"""Miles plugin entry point of miles-algorithms (hook implementations live here)."""
