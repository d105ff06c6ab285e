"""Miles plugin entry point of miles-tracker-mlflow (hook implementations live here)."""
