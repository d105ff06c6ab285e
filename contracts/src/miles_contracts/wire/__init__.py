"""Wire schemas: the JSON that crosses process boundaries (engine HTTP API, session records)."""
