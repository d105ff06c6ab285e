"""miles-tracker-mlflow: log a Miles run's metrics to MLflow (a local file store by default)."""
