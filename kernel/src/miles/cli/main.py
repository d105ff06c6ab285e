"""Entry point of the ``miles`` script: builds argparse from the registered commands.

Only the command the line names gets its arguments added: a command's ``add_arguments`` may
import its package's heavy code (``miles bench r3``'s imported torch, ~6 s of CPU that every
``miles --help`` paid), and one command must not pay for every installed package's
(``docs/benchmarks/cli.md``).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from miles_contracts import CommandSpec, Process, RunContext

from miles import __version__
from miles.errors import MilesDeprecationWarning, MilesError


def named_command(argv: Sequence[str], commands: dict[str, CommandSpec]) -> str | None:
    """The command that ``argv`` names (its leading words, ``bench engine`` for
    ``bench engine --help``), or None when it names none (``--help``, a group, a typo)."""
    words: list[str] = []
    for arg in argv:
        if arg.startswith("-"):
            break
        words.append(arg)
        if " ".join(words) in commands:
            return " ".join(words)
    return None


def build_parser(commands: dict[str, CommandSpec], selected: str | None = None) -> argparse.ArgumentParser:
    """The ``miles`` parser: every command listed with its help line, the arguments of
    ``selected`` only."""
    parser = argparse.ArgumentParser(
        prog="miles",
        description="Miles: agentic-first RL post-training for LLMs.",
    )
    parser.add_argument("--version", action="version", version=f"miles {__version__}")
    top = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction[argparse.ArgumentParser]] = {}
    for name in sorted(commands):
        command = commands[name]
        parts = name.split()
        action = top
        for depth, part in enumerate(parts[:-1]):
            key = " ".join(parts[: depth + 1])
            if key not in groups:
                group = action.add_parser(part, help=f"{key} commands")
                groups[key] = group.add_subparsers(dest=f"sub_{depth}", metavar="COMMAND", required=True)
            action = groups[key]
        sub = action.add_parser(parts[-1], help=command.help, description=command.description or command.help,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        if command.add_arguments and name == selected:
            command.add_arguments(sub)
        sub.set_defaults(_command=command)
    return parser


def _command_words(argv: Sequence[str]) -> list[str]:
    """The leading words of a command line, up to its first option (``models list`` of
    ``miles models list --json``)."""
    words = []
    for arg in argv:
        if arg.startswith("-"):
            break
        words.append(arg)
    return words


def main(argv: Sequence[str] | None = None) -> int:
    from miles.kernel import Kernel

    # the application shows plugins' deprecations (Python hides DeprecationWarning outside __main__)
    warnings.simplefilter("default", MilesDeprecationWarning)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        kernel = Kernel.load()
        commands = {e.name: e.obj for e in kernel.commands().entries()}
    except MilesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    missing = kernel.install_state.command_hint(_command_words(argv), set(commands))
    if missing:  # argparse would only say "invalid choice"
        print(f"error: {missing}", file=sys.stderr)
        return 2
    parser = build_parser(commands, named_command(argv, commands))
    args = parser.parse_args(argv)
    command: CommandSpec | None = getattr(args, "_command", None)
    if command is None:
        parser.print_help()
        return 0
    from miles.config import MilesConfig

    ctx = RunContext(MilesConfig(), kernel, Process.cli())
    try:
        code = command.run(args, ctx)
    except MilesError as exc:
        from miles.redaction import redact

        print(f"error: {redact(str(exc))}", file=sys.stderr)  # it may quote a log or a command line
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    from miles.server_process import end_if_stopped

    return end_if_stopped(int(code or 0))  # a server told to stop (`miles serve ...`) ends here


if __name__ == "__main__":
    sys.exit(main())
