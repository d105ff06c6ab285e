"""Fault injection: ``miles chaos`` kills a real run's processes and checks its sample ledger."""
