"""`Kernel`: the typed facade over the plugin manager. Nothing else touches ``pm.hook``.

``Kernel.load(selection)`` loads plugins once per process and selection (idempotent, so every
worker process rebuilds the same kernel from the same config). Registries are collected lazily,
the first time a kind is asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from miles.errors import PluginError
from miles.plugins import LoadedPlugins, PluginInfo, PluginSelection, load_plugins
from miles.registry import Entry, Registry

if TYPE_CHECKING:
    from miles_contracts import (
        AdvantageEstimator,
        AgentFn,
        EngineCapture,
        Filter,
        ForwardContext,
        Generator,
        ModelBridge,
        RewardFn,
        Service,
        Tool,
    )
    from pydantic import BaseModel

    from miles.cli.command import Command
    from miles.config import MilesConfig

T = TypeVar("T")

# kind -> (hook name, human name used in messages)
KINDS: dict[str, tuple[str, str]] = {
    "generator": ("miles_register_generators", "generator"),
    "tool": ("miles_register_tools", "tool"),
    "agent": ("miles_register_agents", "agent"),
    "data_source": ("miles_register_data_sources", "data source"),
    "reward": ("miles_register_rewards", "reward"),
    "filter": ("miles_register_filters", "filter"),
    "advantage": ("miles_register_advantages", "advantage estimator"),
    "policy_loss": ("miles_register_policy_losses", "policy loss"),
    "mismatch_correction": ("miles_register_mismatch_corrections", "mismatch correction"),
    "chat_family": ("miles_register_chat_families", "chat family"),
    "train_backend": ("miles_register_train_backends", "train backend"),
    "weight_transport": ("miles_register_weight_transports", "weight transport"),
    "service": ("miles_register_services", "service"),
    "router_middleware": ("miles_register_router_middlewares", "router middleware"),
    "executor": ("miles_register_executors", "executor"),
    "tracker": ("miles_register_trackers", "tracker"),
    "config_section": ("miles_register_config_sections", "config section"),
    "command": ("miles_register_commands", "command"),
}

_KERNELS: dict[PluginSelection, Kernel] = {}


class Kernel:
    """Loaded plugins, their registries and typed calls of every hook."""

    def __init__(self, loaded: LoadedPlugins, selection: PluginSelection) -> None:
        self._loaded = loaded
        self._pm = loaded.manager
        self.selection = selection
        self._registries: dict[str, Registry[Any]] = {}
        self._check_forward_wrappers()

    # ------------------------------------------------------------------ construction

    @classmethod
    def load(cls, selection: PluginSelection | None = None) -> Kernel:
        """The kernel for ``selection`` (default: env only), loaded once per process."""
        selection = selection or PluginSelection.from_settings(None, ())
        kernel = _KERNELS.get(selection)
        if kernel is None:
            kernel = _KERNELS[selection] = cls(load_plugins(selection), selection)
        return kernel

    @classmethod
    def clear_cache(cls) -> None:
        """Forget loaded kernels (tests that install plugins mid-process)."""
        _KERNELS.clear()

    def register_plugin(self, plugin: object, name: str) -> None:
        """Register an in-process plugin object (tests, notebooks); registries are rebuilt."""
        self._pm.register(plugin, name=name)
        self._pm.check_pending()
        self._registries.clear()
        self._check_forward_wrappers()

    def unregister_plugin(self, name: str) -> None:
        self._pm.unregister(name=name)
        self._registries.clear()

    # ------------------------------------------------------------------ introspection

    def plugins(self) -> list[PluginInfo]:
        """Every installed plugin with its status; in-process registrations included."""
        infos = list(self._loaded.infos)
        known = {i.name for i in infos}
        for name, plugin in self._pm.list_name_plugin():
            if name not in known and plugin is not None:
                hooks = tuple(sorted(h.name for h in self._pm.get_hookcallers(plugin) or ()))
                infos.append(PluginInfo(name, None, None, repr(plugin), hooks, "loaded"))
        return sorted(infos, key=lambda i: i.name)

    # ------------------------------------------------------------------ registries

    def registry(self, kind: str) -> Registry[Any]:
        if kind not in KINDS:
            raise KeyError(f"unknown registry kind {kind!r}; kinds: {', '.join(KINDS)}")
        registry = self._registries.get(kind)
        if registry is None:
            registry = self._registries[kind] = self._collect(kind)
        return registry

    def _collect(self, kind: str) -> Registry[Any]:
        hook_name, human = KINDS[kind]
        registry: Registry[Any] = Registry(human, hook_name)
        caller = getattr(self._pm.hook, hook_name)
        for impl in caller.get_hookimpls():  # registration order
            plugin_name = impl.plugin_name
            dist, version = self._loaded.distribution_of(plugin_name)

            def register(name: str, obj: Any, _p: str = plugin_name, _d: str | None = dist, _v: str | None = version) -> None:
                registry.add(Entry(name, obj, _p, _d, _v))

            kwargs = {"register": register}
            try:
                impl.function(**{k: kwargs[k] for k in impl.argnames})
            except PluginError:
                raise
            except Exception as exc:
                raise PluginError(
                    f"plugin {plugin_name!r} ({dist} {version}) failed in {hook_name}: {type(exc).__name__}: {exc}"
                ) from exc
        return registry

    def generators(self) -> Registry[Generator]:
        return self.registry("generator")

    def tools(self) -> Registry[Tool]:
        return self.registry("tool")

    def agents(self) -> Registry[AgentFn]:
        return self.registry("agent")

    def data_sources(self) -> Registry[Callable[..., Any]]:
        return self.registry("data_source")

    def rewards(self) -> Registry[RewardFn]:
        return self.registry("reward")

    def filters(self) -> Registry[Filter]:
        return self.registry("filter")

    def advantages(self) -> Registry[AdvantageEstimator]:
        return self.registry("advantage")

    def policy_losses(self) -> Registry[Callable[..., Any]]:
        return self.registry("policy_loss")

    def mismatch_corrections(self) -> Registry[Callable[..., Any]]:
        return self.registry("mismatch_correction")

    def chat_families(self) -> Registry[Any]:
        return self.registry("chat_family")

    def train_backends(self) -> Registry[Callable[..., Any]]:
        return self.registry("train_backend")

    def weight_transports(self) -> Registry[Callable[..., Any]]:
        return self.registry("weight_transport")

    def services(self) -> Registry[Service]:
        return self.registry("service")

    def router_middlewares(self) -> Registry[Callable[..., Any]]:
        return self.registry("router_middleware")

    def executors(self) -> Registry[Callable[..., Any]]:
        return self.registry("executor")

    def trackers(self) -> Registry[Callable[..., Any]]:
        return self.registry("tracker")

    def config_sections(self) -> Registry[type[BaseModel]]:
        return self.registry("config_section")

    def commands(self) -> Registry[Command]:
        return self.registry("command")

    # ------------------------------------------------------------------ claims

    def find_model_bridge(self, hf_config: Mapping[str, Any]) -> ModelBridge | None:
        return self._pm.hook.miles_model_bridge(hf_config=hf_config)

    def model_bridge(self, hf_config: Mapping[str, Any]) -> ModelBridge:
        bridge = self.find_model_bridge(hf_config)
        if bridge is None:
            claimers = [i.name for i in self.plugins() if "miles_model_bridge" in i.hooks]
            arch = hf_config.get("architectures") or hf_config.get("model_type") or "?"
            raise PluginError(
                f"no model plugin recognises architecture {arch}; installed model plugins: "
                f"{', '.join(claimers) or 'none'}. Install one (e.g. pip install miles-model-llama) "
                f"or write a bridge (docs/plugins/writing-a-plugin.md)"
            )
        return bridge

    def resolve_model(self, name: str) -> Path:
        """A local model folder for ``name``: the path itself, or what a plugin resolves it to."""
        path = Path(name).expanduser()
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise PluginError(f"model folder {path} has no config.json; point model.name at a Hugging Face model folder")
            return path
        resolved = self._pm.hook.miles_resolve_model(name=name)
        if resolved is None:
            resolvers = [i.name for i in self.plugins() if "miles_resolve_model" in i.hooks]
            raise PluginError(
                f"model {name!r} is not a local folder and no plugin knows it (resolvers: "
                f"{', '.join(resolvers) or 'none; pip install miles-models'}); `miles models list` shows known models"
            )
        return Path(resolved)

    # ------------------------------------------------------------------ rollout captures

    def engine_captures(self, config: MilesConfig) -> list[EngineCapture]:
        """Every plugin's engine captures for ``config`` (see ``miles_engine_captures``)."""
        captures = [c for answer in self._pm.hook.miles_engine_captures(config=config) for c in answer or ()]
        names = [c.spec.name for c in captures]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise PluginError(f"engine capture name(s) {twice} are returned by more than one plugin; capture names must be unique")
        return captures

    # ------------------------------------------------------------------ wrappers

    def run_forward(self, ctx: ForwardContext, forward: Callable[[], T]) -> T:
        """Run ``forward()`` inside every ``miles_forward`` wrapper (outermost first)."""

        def innermost(ctx: ForwardContext) -> T:
            return forward()

        return self._pm.hook.miles_forward.call_extra([innermost], {"ctx": ctx})

    def _check_forward_wrappers(self) -> None:
        for impl in self._pm.hook.miles_forward.get_hookimpls():
            if not (impl.wrapper or impl.hookwrapper):
                raise PluginError(
                    f"plugin {impl.plugin_name!r} implements miles_forward without wrapper=True; "
                    f"use @hookimpl(wrapper=True) and yield to the forward pass"
                )

    # ------------------------------------------------------------------ lifecycle

    def configure(self, config: MilesConfig) -> None:
        self._pm.hook.miles_configure.call_historic(kwargs={"config": config})

    def run_start(self, config: MilesConfig, run_dir: Path) -> None:
        self._pm.hook.miles_run_start(config=config, run_dir=run_dir)

    def step_end(self, step: int, metrics: dict[str, float]) -> None:
        self._pm.hook.miles_step_end(step=step, metrics=metrics)

    def train_step_end(self, metrics: dict[str, float]) -> None:
        self._pm.hook.miles_train_step_end(metrics=metrics)

    def weights_synced(self, version: int) -> None:
        self._pm.hook.miles_weights_synced(version=version)

    def run_end(self, run_dir: Path, status: str) -> None:
        self._pm.hook.miles_run_end(run_dir=run_dir, status=status)
