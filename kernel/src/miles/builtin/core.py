"""Built-in plugin ``core`` (essential): the ``plugins`` and ``config show`` commands."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from miles_contracts import CommandSpec, RunContext

from miles.cli.config_args import add_config_arguments, split_config_args
from miles.hookspecs import hookimpl
from miles.registry import Register


def _plugins(args: argparse.Namespace, ctx: RunContext) -> int:
    from miles.config import PluginsSection, read_yaml
    from miles.kernel import Kernel
    from miles.plugins import PluginSelection

    selection = None
    if args.config:
        raw = read_yaml(Path(args.config)).get("plugins") or {}
        settings = PluginsSection.model_validate(raw)
        selection = PluginSelection.from_settings(settings.enable, settings.disable)
    infos = (Kernel.load(selection) if selection is not None else ctx.kernel).plugins()
    if args.json:
        print(json.dumps([
            {"name": i.name, "distribution": i.distribution, "version": i.version, "module": i.module,
             "hooks": list(i.hooks), "status": i.status}
            for i in infos
        ], indent=2))
        return 0
    rows = [("NAME", "DISTRIBUTION", "VERSION", "STATUS", "HOOKS")]
    for i in infos:
        hooks = ", ".join(h.removeprefix("miles_") for h in i.hooks) or "-"
        rows.append((i.name, i.distribution or "-", i.version or "-", i.status, hooks))
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    for r in rows:
        print("  ".join(r[c].ljust(widths[c]) for c in range(4)) + "  " + r[4])
    return 0


def _plugins_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--config", help="apply this config's plugins.enable / plugins.disable")


CONFIG_SHOW_DESCRIPTION = """\
Validate a config and print it fully resolved (defaults included). Takes the same arguments as
`miles train`: an optional YAML file first, then section.key=value overrides.

  miles config show                                   # the defaults
  miles config show examples/arithmetic/config.yaml
  miles config show run.mode=one_step_off algorithm.correction=tis rollout.temperature=0.8
  miles config show examples/arithmetic/config.yaml run.steps=20 --json
"""


def _config_show(args: argparse.Namespace, ctx: RunContext) -> int:
    """Print the resolved config even where it names what is not installed (a bare ``miles-kernel``
    shows the defaults), then list those names with the package of each; exit 2 if there are any,
    as ``miles train`` would refuse the config."""
    import sys

    from miles.config import load_config, unresolved_names
    from miles.errors import ConfigError
    from miles.kernel import Kernel

    config_path, overrides = split_config_args(args.items)
    cfg = load_config(config_path, overrides, check_names=False)
    print(json.dumps(cfg.to_dict(), indent=2) if args.json else cfg.to_yaml(), end="" if not args.json else "\n")
    missing = unresolved_names(cfg, Kernel.load(cfg.plugin_selection))  # the kernel load_config used
    if missing:
        source = str(config_path) if config_path is not None else None
        print(f"error: {ConfigError(missing, source=source)}", file=sys.stderr)
        return 2
    return 0


def _config_args(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of YAML")


@hookimpl
def miles_register_commands(register: Register[CommandSpec]) -> None:
    register("plugins", CommandSpec(
        "list installed plugins: name, distribution, version, status, hooks",
        _plugins, add_arguments=_plugins_args,
    ))
    register("config show", CommandSpec(
        "validate a config and print it fully resolved (defaults included)",
        _config_show, add_arguments=_config_args, description=CONFIG_SHOW_DESCRIPTION,
    ))
