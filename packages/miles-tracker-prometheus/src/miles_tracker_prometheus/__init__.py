"""miles-tracker-prometheus: serve a Miles run's metrics to Prometheus from the driver."""
