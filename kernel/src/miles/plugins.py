"""Plugin discovery and loading.

Every plugin -- the kernel's own built-ins included -- is a module named by an entry point in the
``miles`` group; the entry-point name is the plugin's name (what ``plugins.disable`` and
``MILES_DISABLE_PLUGINS`` refer to). Loading, in order:

1. check the names: every name in ``plugins.enable``, ``plugins.disable`` and
   ``MILES_DISABLE_PLUGINS`` (comma-separated) must be an installed plugin -- a misspelled
   disable would leave on the plugin the user meant to turn off -- and essential plugins refuse
   to be disabled. "Installed" means a distribution declares the entry point, whether or not its
   module imports: disabling is how a user gets past a plugin that fails to;
2. block every disabled name with ``set_blocked``;
3. import and register each entry point, skipping blocked names and, when ``plugins.enable`` is
   set (allow-list mode), names not in it;
4. ``check_pending()``: a misspelled ``miles_*`` hook implementation is an error, not a no-op.

A plugin that fails to import is an error naming its distribution, entry point and the import
error, with the command to disable it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata

import pluggy

from miles import hookspecs
from miles.errors import PluginError, closest_name

ENTRY_POINT_GROUP = "miles"
DISABLE_ENV = "MILES_DISABLE_PLUGINS"
ESSENTIAL_PLUGINS = frozenset({"core"})


@dataclass(frozen=True, slots=True)
class PluginInfo:
    """One plugin as ``miles plugins`` shows it."""

    name: str
    distribution: str | None
    version: str | None
    module: str
    hooks: tuple[str, ...] = ()
    status: str = "loaded"  # loaded | blocked | not enabled


@dataclass(frozen=True, slots=True)
class PluginSelection:
    """Which plugins to load: ``enable`` (allow-list, None = all) and the block-list, kept apart
    by where it came from so that an error can say which one to fix: ``disable`` (the config's
    ``plugins.disable``) and ``disable_env`` (``MILES_DISABLE_PLUGINS``)."""

    enable: tuple[str, ...] | None = None
    disable: tuple[str, ...] = ()
    disable_env: tuple[str, ...] = ()

    @classmethod
    def from_settings(cls, enable: Iterable[str] | None, disable: Iterable[str]) -> PluginSelection:
        """The config's ``plugins.enable`` / ``plugins.disable`` with ``MILES_DISABLE_PLUGINS``."""
        env = [n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()]
        return cls(
            enable=tuple(sorted(set(enable))) if enable is not None else None,
            disable=tuple(sorted(set(disable))),
            disable_env=tuple(sorted(set(env))),
        )

    @property
    def blocked(self) -> frozenset[str]:
        """Every disabled name, from the config or the environment."""
        return frozenset(self.disable) | frozenset(self.disable_env)


@dataclass(slots=True)
class LoadedPlugins:
    manager: pluggy.PluginManager
    infos: list[PluginInfo] = field(default_factory=list)

    def distribution_of(self, plugin_name: str) -> tuple[str | None, str | None]:
        for info in self.infos:
            if info.name == plugin_name:
                return info.distribution, info.version
        return None, None


def _entry_points() -> list[metadata.EntryPoint]:
    return sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)


def _dist(ep: metadata.EntryPoint) -> tuple[str | None, str | None]:
    dist = ep.dist
    if dist is None:
        return None, None
    return dist.metadata["Name"], dist.version


def load_plugins(selection: PluginSelection) -> LoadedPlugins:
    """Build the plugin manager for ``selection`` (see the module docstring for the order)."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    entry_points = _entry_points()
    available = {ep.name for ep in entry_points}

    _check_names(selection, available)
    for name in sorted(selection.blocked):
        pm.set_blocked(name)

    loaded = LoadedPlugins(pm)
    seen: dict[str, metadata.EntryPoint] = {}
    for ep in entry_points:
        dist, version = _dist(ep)
        if ep.name in seen:
            other, _ = _dist(seen[ep.name])
            raise PluginError(
                f"two distributions register the plugin name {ep.name!r}: {other} and {dist}; "
                f"uninstall one of them"
            )
        seen[ep.name] = ep
        status = "loaded"
        if pm.is_blocked(ep.name):
            status = "blocked"
        elif selection.enable is not None and ep.name not in selection.enable and ep.name not in ESSENTIAL_PLUGINS:
            status = "not enabled"
        if status != "loaded":
            loaded.infos.append(PluginInfo(ep.name, dist, version, ep.value, (), status))
            continue
        try:
            module = ep.load()
        except Exception as exc:  # any import-time failure of third-party code
            raise PluginError(
                f"plugin {ep.name!r} (entry point '{ep.name} = {ep.value}' of distribution {dist} {version}) "
                f"failed to import: {type(exc).__name__}: {exc}\n{_disable_hint(ep.name)}"
            ) from exc
        try:
            pm.register(module, name=ep.name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(
                f"plugin {ep.name!r} ({dist} {version}) is invalid: {exc}\n{_disable_hint(ep.name)}"
            ) from exc
        hooks = tuple(sorted(h.name for h in pm.get_hookcallers(module) or ()))
        loaded.infos.append(PluginInfo(ep.name, dist, version, ep.value, hooks, status))

    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        plugin_name = pm.get_name(exc.plugin) if exc.plugin is not None else "?"
        dist, version = loaded.distribution_of(plugin_name or "")
        raise PluginError(
            f"plugin {plugin_name!r} ({dist} {version}) implements a hook Miles does not define: {exc}; "
            f"hooks are listed in docs/plugins/hooks.md{_closest_hooks(pm)}\n{_disable_hint(plugin_name or '?')}"
        ) from exc
    return loaded


def _check_names(selection: PluginSelection, installed: set[str]) -> None:
    """Every problem with the names of ``selection`` at once (see step 1 of the module docstring)."""
    problems = []
    refused = sorted(selection.blocked & ESSENTIAL_PLUGINS)
    if refused:
        problems.append(f"plugin(s) {', '.join(refused)} cannot be disabled: the kernel needs them")
    for source, names in (("plugins.enable", selection.enable or ()), ("plugins.disable", selection.disable),
                          (DISABLE_ENV, selection.disable_env)):
        unknown = sorted(set(names) - installed)
        if unknown:
            problems.append(f"{source} names plugin(s) that are not installed: {_with_guesses(unknown, installed)}; "
                            f"installed: {', '.join(sorted(installed))}")
    if problems:
        raise PluginError("\n".join(problems))


def _with_guesses(names: list[str], installed: set[str]) -> str:
    """``lamma (did you mean 'llama'?), nosuch``."""
    return ", ".join(f"{n} (did you mean {close!r}?)" if (close := closest_name(n, installed)) else n for n in names)


def _disable_hint(name: str) -> str:
    return (
        f"  fix the package, uninstall it, or disable it: MILES_DISABLE_PLUGINS={name} "
        f"(or plugins.disable: [{name}] in the config)"
    )


def _closest_hooks(pm: pluggy.PluginManager) -> str:
    """' (did you mean ...?)' for implementations whose name matches no hook spec."""
    import difflib

    specs = [n for n, c in vars(pm.hook).items() if isinstance(c, pluggy.HookCaller) and c.spec is not None]
    unknown = [n for n, c in vars(pm.hook).items() if isinstance(c, pluggy.HookCaller) and c.spec is None and c.get_hookimpls()]
    guesses = [f"{n} -> {m[0]}" for n in unknown if (m := difflib.get_close_matches(n, specs, n=1))]
    return f" (did you mean: {', '.join(guesses)}?)" if guesses else ""
