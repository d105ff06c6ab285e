"""Plugin ``models``: the ``miles models pull`` and ``miles models list`` commands, and model names
resolved to the cache (pulled on first use)."""

from __future__ import annotations

import argparse

from miles import hookimpl
from miles.registry import Register
from miles_contracts import CommandSpec, RunContext


def _pull(args: argparse.Namespace, ctx: RunContext) -> int:
    from miles_models.pull import pull

    path = pull(args.name, force=args.force)
    print(path)
    return 0


def _pull_args(p: argparse.ArgumentParser) -> None:
    from miles_models.catalog import CATALOG

    p.add_argument("name", choices=sorted(CATALOG), help="model to fetch and convert")
    p.add_argument("--force", action="store_true", help="fetch and convert again even if cached")


def _list(args: argparse.Namespace, ctx: RunContext) -> int:
    from miles_models.cache import list_cached, models_dir
    from miles_models.catalog import CATALOG

    cached = {m.name: m for m in list_cached()}
    print(f"cache: {models_dir()}")
    for name in CATALOG:
        m = cached.get(name)
        state = f"cached  {m.size_bytes / 1e6:,.0f} MB  {m.path}" if m else f"not cached (miles models pull {name})"
        print(f"{name:28} {state}")
    for name, m in cached.items():
        if name not in CATALOG:
            print(f"{name:28} cached  {m.size_bytes / 1e6:,.0f} MB  {m.path}")
    return 0


@hookimpl
def miles_register_commands(register: Register[CommandSpec]) -> None:
    register("models pull", CommandSpec("fetch a known model and convert it to safetensors in the cache",
                                        _pull, add_arguments=_pull_args))
    register("models list", CommandSpec("list known models and what is cached", _list))


@hookimpl
def miles_model_names() -> list[str]:
    """The catalogued names (what :func:`miles_resolve_model` claims)."""
    from miles_models.catalog import CATALOG

    return list(CATALOG)


@hookimpl
def miles_resolve_model(name: str):
    """Known model names resolve to the cache, pulled on first use; other names are not ours."""
    from miles_models.catalog import CATALOG
    from miles_models.pull import pull

    return pull(name) if name in CATALOG else None
