"""Miles plugin entry point of miles-model-llama (hook implementations live here)."""
