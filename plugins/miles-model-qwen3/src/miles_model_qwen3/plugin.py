"""Miles plugin entry point of miles-model-qwen3 (hook implementations live here)."""
