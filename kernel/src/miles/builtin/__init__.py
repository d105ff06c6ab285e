"""The kernel's built-in plugins. Each module is registered through the ``miles`` entry-point
group exactly like a third-party plugin (see ``kernel/pyproject.toml``)."""
