"""miles-tracker-wandb: log a Miles run's metrics to Weights & Biases (online or offline)."""
