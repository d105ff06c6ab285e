"""Miles plugin entry point of miles-fsdp (hook implementations live here)."""
