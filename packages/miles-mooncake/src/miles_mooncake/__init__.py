"""Mooncake weight transport: ``weights.transport: mooncake`` (see :mod:`miles_mooncake.transport`)."""
