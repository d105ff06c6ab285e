"""The ``miles`` command line. Commands come from plugins (``miles_register_commands``)."""

from miles.cli.command import Command, emit_json

__all__ = ["Command", "emit_json"]
