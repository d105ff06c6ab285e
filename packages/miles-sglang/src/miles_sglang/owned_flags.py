"""The SGLang flags Miles sets itself, found in ``sglang.sglang_args`` the way SGLang would read them.

SGLang parses its argv with ``argparse`` (``allow_abbrev`` on, its default), so more spellings reach
a flag than its name: an alias (``--model`` is ``--model-path``, ``--tensor-parallel-size`` is
``--tp-size``), any prefix that names one option only (``--hos`` is ``--host``, ``--api-k`` is
``--api-key``), and the ``--flag=value`` form of each. A check of exact names lets all of them
through, and argparse keeps the last value given: ``sglang_args`` come last, so ``["--hos",
"0.0.0.0"]`` would move an engine off loopback and ``["--api-k", "x"]`` would replace the run's
token.

:func:`owned_flags` reads an argument as argparse does: an argument that starts with ``--`` names
the option it spells in full, or whose name it begins. A prefix of an owned flag is refused even
where SGLang would find it ambiguous (``--p``): SGLang would refuse it too, so nothing usable is
lost. After a bare ``--`` argparse reads no options, and neither does this.
"""

from __future__ import annotations

from collections.abc import Iterable

OWNED = {
    "--model-path": "--model-path", "--model": "--model-path",
    "--host": "--host",
    "--port": "--port",
    "--api-key": "--api-key",
    "--tp-size": "--tp-size", "--tensor-parallel-size": "--tp-size",
    "--dp-size": "--dp-size", "--data-parallel-size": "--dp-size",
    "--ep-size": "--ep-size", "--expert-parallel-size": "--ep-size", "--ep": "--ep-size",
}
"""Every spelling SGLang (0.5.13) declares for an option Miles sets, and that option's name."""


def owned_flags(args: Iterable[str]) -> list[tuple[str, str]]:
    """``(argument as given, the owned option it reaches)`` for every argument of ``args`` that
    SGLang would read as an option Miles sets."""
    found = []
    for arg in args:
        if arg == "--":
            break
        if not arg.startswith("--"):
            continue
        name = arg.split("=", 1)[0]
        option = OWNED.get(name) or next((OWNED[full] for full in OWNED if full.startswith(name)), None)
        if option is not None:
            found.append((arg, option))
    return found
