"""Entry point of the ``miles`` script: builds argparse from the registered commands."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from miles_contracts import CommandSpec, Process, RunContext

from miles import __version__
from miles.errors import MilesDeprecationWarning, MilesError


def build_parser(commands: dict[str, CommandSpec]) -> argparse.ArgumentParser:
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
        if command.add_arguments:
            command.add_arguments(sub)
        sub.set_defaults(_command=command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from miles.config import MilesConfig
    from miles.kernel import Kernel

    # the application shows plugins' deprecations (Python hides DeprecationWarning outside __main__)
    warnings.simplefilter("default", MilesDeprecationWarning)
    try:
        kernel = Kernel.load()
        commands = {e.name: e.obj for e in kernel.commands().entries()}
    except MilesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    parser = build_parser(commands)
    args = parser.parse_args(argv)
    command: CommandSpec | None = getattr(args, "_command", None)
    if command is None:
        parser.print_help()
        return 0
    ctx = RunContext(MilesConfig(), kernel, Process.cli())
    try:
        code = command.run(args, ctx)
    except MilesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    from miles.server_process import end_if_stopped

    return end_if_stopped(int(code or 0))  # a server told to stop (`miles serve ...`) ends here


if __name__ == "__main__":
    sys.exit(main())
