"""The ``miles`` command line. Commands come from plugins (``miles_register_commands``, each a
:class:`miles_contracts.CommandSpec`)."""

from miles_contracts import CommandSpec

from miles.cli.command import Command, emit_json

__all__ = ["Command", "CommandSpec", "emit_json"]
