"""`Kernel`: the typed facade over the plugin manager. Nothing else touches ``pm.hook``.

``Kernel.load(selection)`` loads plugins once per process and selection (idempotent, so every
worker process rebuilds the same kernel from the same config). Registries are collected lazily,
the first time a kind is asked for.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from miles.errors import MilesDeprecationWarning, PluginError, closest_name
from miles.install_hints import InstallState
from miles.kinds import (
    ADVANTAGE,
    AGENT,
    CHAT_FAMILY,
    COMMAND,
    CONFIG_SECTION,
    DATA_SOURCE,
    EXECUTOR,
    FILTER,
    GENERATOR,
    KINDS,
    MISMATCH_CORRECTION,
    POLICY_LOSS,
    REWARD,
    ROUTER_MIDDLEWARE,
    SERVICE,
    TOOL,
    TRACKER,
    TRAIN_BACKEND,
    WEIGHT_TRANSPORT,
    Kind,
)
from miles.legacy import LEGACY_ATTRIBUTES
from miles.plugins import LoadedPlugins, PluginInfo, PluginSelection, load_plugins
from miles.registry import Entry, Registry

if TYPE_CHECKING:
    from miles_contracts import EngineCapture, ForwardContext, ModelBridge, RunContext, specs
    from miles_contracts.chat import ChatFamily

    from miles.config import MilesConfig

T = TypeVar("T")
S = TypeVar("S")

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
        """The kernel for ``selection`` (default: env only), loaded once per process.

        For entry points of a process (``miles train``, a trainer rank, a service's ``main``),
        which then hand the kernel on in a :class:`~miles_contracts.RunContext`; plugins use the
        context they are given, never this.
        """
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

    @property
    def install_state(self) -> InstallState:
        """Which plugins loaded and which are installed but switched off: what the "which package
        provides it" hints of errors say (:mod:`miles.install_hints`)."""
        infos = self._loaded.infos
        return InstallState(frozenset(i.name for i in infos if i.status == "loaded"),
                            {i.name: i.status for i in infos if i.status != "loaded"})

    # ------------------------------------------------------------------ registries

    def registry(self, kind: str) -> Registry[Any]:
        """The registry of ``kind`` by its name (config validation checks names this way)."""
        if kind not in KINDS:
            raise KeyError(f"unknown registry kind {kind!r}; kinds: {', '.join(KINDS)}")
        return self._typed(KINDS[kind])

    def _typed(self, kind: Kind[S]) -> Registry[S]:
        registry = self._registries.get(kind.name)
        if registry is None:
            registry = self._registries[kind.name] = self._collect(kind)
        return registry

    def _collect(self, kind: Kind[S]) -> Registry[S]:
        state = self.install_state
        registry: Registry[S] = Registry(kind.human, kind.hook, install=state.kind_hint(kind.name),
                                         name_hint=lambda name: state.name_hint(kind.name, name))
        caller = getattr(self._pm.hook, kind.hook)
        for impl in caller.get_hookimpls():  # registration order
            plugin_name = impl.plugin_name
            dist, version = self._loaded.distribution_of(plugin_name)

            def register(name: str, spec: Any, _p: str = plugin_name, _d: str | None = dist,
                         _v: str | None = version) -> None:
                registry.add(Entry(name, self._as_spec(kind, name, spec, _p), _p, _d, _v))

            kwargs = {"register": register}
            try:
                impl.function(**{k: kwargs[k] for k in impl.argnames})
            except PluginError:
                raise
            except Exception as exc:
                origin = f" ({dist} {version})" if dist else ""
                raise PluginError(
                    f"plugin {plugin_name!r}{origin} failed in {kind.hook}: {type(exc).__name__}: {exc}"
                ) from exc
        return registry

    @staticmethod
    def _as_spec(kind: Kind[S], name: str, obj: Any, plugin: str) -> S:
        """``obj`` if it is the kind's spec; a bare object of the old style adapted (with a
        deprecation warning); anything else an error naming the spec."""
        if isinstance(obj, kind.spec):
            return obj
        spec_name = kind.spec.__name__
        if kind.adapt is None:
            raise PluginError(f"plugin {plugin!r} registered {kind.human} {name!r} as a {type(obj).__name__}; "
                              f"register a miles_contracts {spec_name}")
        try:
            spec = kind.adapt(obj)
        except (TypeError, ValueError, AttributeError) as exc:
            raise PluginError(f"plugin {plugin!r} registered {kind.human} {name!r} as a {type(obj).__name__}, "
                              f"not a {spec_name}, and it cannot be adapted ({exc}); register "
                              f"miles_contracts.{spec_name}(...)") from None
        carried = LEGACY_ATTRIBUTES.get(kind.name)
        declared = f" (its attributes {', '.join(carried)} become spec fields)" if carried else ""
        warnings.warn(f"plugin {plugin!r} registered {kind.human} {name!r} as a bare {type(obj).__name__}; register "
                      f"miles_contracts.{spec_name}(...) instead{declared}. Bare objects are adapted until Miles 0.3.",
                      MilesDeprecationWarning, stacklevel=3)
        return spec

    def generators(self) -> Registry[specs.GeneratorSpec]:
        return self._typed(GENERATOR)

    def tools(self) -> Registry[specs.ToolSpec]:
        return self._typed(TOOL)

    def agents(self) -> Registry[specs.AgentSpec]:
        return self._typed(AGENT)

    def data_sources(self) -> Registry[specs.DataSourceSpec]:
        return self._typed(DATA_SOURCE)

    def rewards(self) -> Registry[specs.RewardSpec]:
        return self._typed(REWARD)

    def filters(self) -> Registry[specs.FilterSpec]:
        return self._typed(FILTER)

    def advantages(self) -> Registry[specs.AdvantageSpec]:
        return self._typed(ADVANTAGE)

    def policy_losses(self) -> Registry[specs.PolicyLossSpec]:
        return self._typed(POLICY_LOSS)

    def mismatch_corrections(self) -> Registry[specs.CorrectionSpec]:
        return self._typed(MISMATCH_CORRECTION)

    def chat_families(self) -> Registry[ChatFamily]:
        return self._typed(CHAT_FAMILY)

    def train_backends(self) -> Registry[specs.TrainBackendSpec]:
        return self._typed(TRAIN_BACKEND)

    def weight_transports(self) -> Registry[specs.WeightTransportSpec]:
        return self._typed(WEIGHT_TRANSPORT)

    def services(self) -> Registry[specs.ServiceSpec]:
        return self._typed(SERVICE)

    def router_middlewares(self) -> Registry[specs.RouterMiddlewareSpec]:
        return self._typed(ROUTER_MIDDLEWARE)

    def executors(self) -> Registry[specs.ExecutorSpec]:
        return self._typed(EXECUTOR)

    def trackers(self) -> Registry[specs.TrackerSpec]:
        return self._typed(TRACKER)

    def config_sections(self) -> Registry[specs.ConfigSectionSpec]:
        return self._typed(CONFIG_SECTION)

    def commands(self) -> Registry[specs.CommandSpec]:
        return self._typed(COMMAND)

    # ------------------------------------------------------------------ claims

    def find_model_bridge(self, hf_config: Mapping[str, Any]) -> ModelBridge | None:
        bridge: ModelBridge | None = self._pm.hook.miles_model_bridge(hf_config=hf_config)
        return bridge

    def model_bridge(self, hf_config: Mapping[str, Any]) -> ModelBridge:
        bridge = self.find_model_bridge(hf_config)
        if bridge is None:
            claimers = [i.name for i in self.plugins() if "miles_model_bridge" in i.hooks]
            architectures = [str(a) for a in hf_config.get("architectures") or ()]
            model_type = hf_config.get("model_type")
            arch = ", ".join(architectures) or "?"
            arch += f" (model_type {model_type})" if model_type else ""
            hint = self.install_state.model_hint([*architectures, *([str(model_type)] if model_type else [])])
            fix = hint or "install the model plugin of this family or write a bridge (docs/plugins/writing-a-plugin.md)"
            raise PluginError(
                f"no model plugin recognises architecture {arch}; installed model plugins: "
                f"{', '.join(claimers) or 'none'}; {fix}"
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
            known = self.model_names()
            close = closest_name(name, known)
            raise PluginError(
                f"model {name!r} is not a local folder and no plugin knows it (resolvers: "
                f"{', '.join(resolvers) or 'none; pip install miles-models'}). "
                + (f"Did you mean {close!r}? " if close else "")
                + (f"Known models: {', '.join(known)} (`miles models list` shows which are cached)" if known
                   else "`miles models list` shows known models")
            )
        return Path(resolved)

    def model_names(self) -> list[str]:
        """Every model name the plugins' resolvers list (``miles_model_names``), in order, once each."""
        answers = self._pm.hook.miles_model_names()
        return list(dict.fromkeys(name for answer in answers for name in answer or ()))

    # ------------------------------------------------------------------ rollout captures

    def engine_captures(self, ctx: RunContext) -> list[EngineCapture]:
        """Every plugin's engine captures for the run of ``ctx`` (see ``miles_engine_captures``)."""
        answers = self._pm.hook.miles_engine_captures(config=ctx.config, ctx=ctx)
        captures = [c for answer in answers for c in answer or ()]
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

        result: T = self._pm.hook.miles_forward.call_extra([innermost], {"ctx": ctx})
        return result

    def _check_forward_wrappers(self) -> None:
        for impl in self._pm.hook.miles_forward.get_hookimpls():
            if not (impl.wrapper or impl.hookwrapper):
                raise PluginError(
                    f"plugin {impl.plugin_name!r} implements miles_forward without wrapper=True; "
                    f"use @hookimpl(wrapper=True) and yield to the forward pass"
                )

    # ------------------------------------------------------------------ lifecycle

    def configure(self, ctx: RunContext) -> None:
        """``miles_configure`` in this process (``ctx.process``), once its config is loaded."""
        self._pm.hook.miles_configure.call_historic(kwargs={"config": ctx.config, "ctx": ctx})

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
