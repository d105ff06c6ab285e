"""miles-tracker-tensorboard: log a Miles run's metrics as TensorBoard scalars."""
