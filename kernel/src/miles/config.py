"""Typed config: YAML plus ``a.b=c`` overrides, validated section by section, all errors at once.

Loading order: read YAML, apply overrides, read the ``plugins`` section alone (it decides which
plugins load), load the kernel for it, then validate every section -- the kernel's own and those
plugins registered -- and every name that refers to a registry. Nothing is silently rewritten: a
value the user gave is either used as given or reported. The one exception is a section named
after an installed plugin that ``plugins.disable`` / ``plugins.enable`` switched off: it is not
validated (its plugin is not there to) and has no effect.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import yaml
from pydantic import BaseModel, ValidationError

from miles.errors import ConfigError, closest_name
from miles.plugins import PluginSelection
from miles.sections import (
    CORE_SECTIONS,
    MOVED_KEYS,
    AlgorithmSection,
    Choice,
    DataSection,
    EvalSection,
    ExecutorSection,
    ModelSection,
    PluginsSection,
    ResourcesSection,
    RewardSection,
    RolloutSection,
    RunSection,
    TrackingSection,
    TrainSection,
    WeightsSection,
)

if typing.TYPE_CHECKING:
    from miles.kernel import Kernel

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class MilesConfig:
    """A validated config. Core sections are attributes; plugin sections via :meth:`section`."""

    plugins: PluginsSection = field(default_factory=PluginsSection)
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    reward: RewardSection = field(default_factory=RewardSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    train: TrainSection = field(default_factory=TrainSection)
    weights: WeightsSection = field(default_factory=WeightsSection)
    eval: EvalSection = field(default_factory=EvalSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)
    executor: ExecutorSection = field(default_factory=ExecutorSection)
    resources: ResourcesSection = field(default_factory=ResourcesSection)
    extra: Mapping[str, BaseModel] = field(default_factory=dict)

    def section(self, name: str, model: type[M]) -> M:
        """A plugin's section, typed. Missing sections were filled with the model's defaults."""
        value = self.extra.get(name)
        if value is None:
            return model()
        if not isinstance(value, model):
            raise TypeError(f"config section {name!r} is a {type(value).__name__}, not {model.__name__}")
        return value

    def to_dict(self) -> dict[str, Any]:
        """The whole config, defaults included, as plain JSON-compatible data."""
        out: dict[str, Any] = {}
        for name in CORE_SECTIONS:
            out[name] = getattr(self, name).model_dump(mode="json")
        for name, value in sorted(self.extra.items()):
            out[name] = value.model_dump(mode="json")
        return out

    def to_yaml(self) -> str:
        text: str = yaml.safe_dump(self.to_dict(), sort_keys=False)
        return text

    @property
    def plugin_selection(self) -> PluginSelection:
        return PluginSelection.from_settings(self.plugins.enable, self.plugins.disable)


# ----------------------------------------------------------------------------- raw data


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError([f"cannot read config file: {exc.strerror}"], source=str(path)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"not valid YAML: {exc}"], source=str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError([f"the top level must be a mapping of sections, got {type(data).__name__}"], source=str(path))
    return data


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> list[str]:
    """Apply ``a.b=c`` overrides in place (values parsed as YAML scalars); return the errors."""
    errors = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            errors.append(f"override {item!r}: expected section.key=value, e.g. rollout.temperature=0.7")
            continue
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                errors.append(f"override {item!r}: {part!r} is a value, not a section")
                break
            node = child
        else:
            node[parts[-1]] = value
    return errors


# ----------------------------------------------------------------------------- validation


def _format_pydantic(section: str, error: ValidationError, model: type[BaseModel]) -> list[str]:
    """One line per error of ``section`` (validated by ``model``); an unknown key gets the
    section's closest key as a guess."""
    lines = []
    for e in error.errors():
        loc = ".".join(str(p) for p in (section, *e["loc"]))
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            # a key of the section itself (sections hold no nested models; a dict of options has no keys to offer)
            keys = list(model.model_fields) if len(e["loc"]) == 1 else []
            close = closest_name(str(e["loc"][0]), keys)
            guess = f"did you mean {section}.{close}? " if close else ""
            msg = f"unknown key ({guess or 'check the spelling; '}`miles config show` prints every key)"
        lines.append(f"{loc}: {msg}")
    return lines


def _choice_errors(path: str, model: BaseModel, kernel: Kernel) -> list[str]:
    """Check every ``Choice``-annotated field of ``model`` against the kernel's registries."""
    errors = []
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        kinds = [m.kind for m in info.metadata if isinstance(m, Choice)]
        kinds += _nested_choices(info.annotation)
        for kind in kinds:
            values = value if isinstance(value, list) else [value]
            registry = kernel.registry(kind)
            for v in values:
                if v is not None and v not in registry:
                    errors.append(f"{path}.{name}: {registry.unknown_message(v)}")
    return errors


def _registry_errors(sections: Mapping[str, BaseModel], kernel: Kernel) -> list[str]:
    """Every name of ``sections`` that refers to a registry and is not registered."""
    return [e for name, value in sections.items() for e in _choice_errors(name, value, kernel)]


def unresolved_names(cfg: MilesConfig, kernel: Kernel) -> list[str]:
    """What a config loaded with ``check_names=False`` names that the installed plugins do not
    provide (each error says which package does), and what the chosen implementations need and do
    not have. Empty for a config the driver would accept."""
    sections: dict[str, BaseModel] = {name: getattr(cfg, name) for name in CORE_SECTIONS}
    errors = _registry_errors({**sections, **cfg.extra}, kernel)
    return errors + _spec_errors(cfg, kernel)


def _with_default_train_backend(data: Mapping[str, Any], kernel: Kernel) -> Mapping[str, Any]:
    """``data`` with ``train.backend`` filled in when the config leaves it out: ``fsdp`` where it
    is installed, else the one train backend that is (``pip install miles-megatron`` alone trains
    with megatron). With none, or several and no fsdp, the section's default stays, and the name
    check says what to install or choose. A value the config gives is never changed."""
    train = data.get("train")
    if train is not None and (not isinstance(train, dict) or "backend" in train):
        return data
    installed = kernel.train_backends().names()
    default = TrainSection.model_fields["backend"].default
    if default in installed or len(installed) != 1:
        return data
    return {**data, "train": {**(train or {}), "backend": installed[0]}}


def _nested_choices(annotation: Any) -> list[str]:
    """Choice markers inside ``list[Annotated[str, Choice(...)]]`` or ``Annotated[...] | None``."""
    found = []
    for arg in typing.get_args(annotation):
        if typing.get_origin(arg) is typing.Annotated:
            found += [m.kind for m in arg.__metadata__ if isinstance(m, Choice)]
        else:
            found += _nested_choices(arg)
    return found


def _cross_section_errors(cfg: MilesConfig) -> list[str]:
    """Settings that contradict each other (no plugin's registry involved)."""
    errors = []
    if cfg.algorithm.kl_loss_coef > 0 and not cfg.train.use_reference:
        errors.append("algorithm.kl_loss_coef > 0 needs a reference model: set train.use_reference: true")
    if cfg.algorithm.kl_coef > 0 and not cfg.train.use_reference:
        errors.append("algorithm.kl_coef > 0 needs a reference model: set train.use_reference: true")
    if cfg.algorithm.opd_coef > 0 and cfg.train.teacher_model is None:
        errors.append("algorithm.opd_coef > 0 needs a teacher: set train.teacher_model to a model name or folder")
    release = cfg.resources.release_engine_memory
    if release != "none" and not cfg.resources.colocate:
        errors.append(f"resources.release_engine_memory ({release}) hands the engines' memory to the trainer on the GPUs "
                      f"they share, but resources.colocate is false (engines have GPUs of their own, nothing would "
                      f"use it); set resources.release_engine_memory: none, or resources.colocate: true")
    errors += true_on_policy_errors(cfg) + reuse_rollout_logprobs_errors(cfg)
    from miles.loop.modes import loop_mode

    errors += loop_mode(cfg).config_errors(cfg)
    if cfg.rollout.max_new_tokens >= cfg.rollout.max_context_len:
        errors.append(
            f"rollout.max_new_tokens ({cfg.rollout.max_new_tokens}) must be below rollout.max_context_len "
            f"({cfg.rollout.max_context_len}) to leave room for the prompt"
        )
    return errors


def true_on_policy_errors(cfg: MilesConfig) -> list[str]:
    """What ``rollout.true_on_policy`` cannot hold with (every one, each naming its fix)."""
    if not cfg.rollout.true_on_policy:
        return []
    errors = []
    where = "rollout.true_on_policy needs"
    if cfg.rollout.engine != "embedded":
        errors.append(f"{where} rollout.engine: embedded (the engine whose forward Miles controls), got "
                      f"{cfg.rollout.engine!r}")
    if cfg.train.backend != "fsdp":
        errors.append(f"{where} train.backend: fsdp (megatron's tensor-parallel reductions have no batch-invariant "
                      f"path), got {cfg.train.backend!r}")
    cpu_low_precision = cfg.model.device == "cpu" and cfg.model.dtype not in ("auto", "float32")
    if cpu_low_precision:
        errors.append(f"{where} model.dtype: float32 on the CPU, or bfloat16 / float32 on CUDA (the invariant kernels "
                      f"are PyTorch row loops on the CPU, Triton kernels on the GPU), got device "
                      f"{cfg.model.device!r}, dtype {cfg.model.dtype!r}")
    if cfg.rollout.top_p < 1.0 or cfg.rollout.top_k > 0:
        errors.append(f"{where} rollout.top_p: 1.0 and rollout.top_k: -1 (the trainer scores the whole distribution, "
                      f"not a truncated one), got top_p {cfg.rollout.top_p}, top_k {cfg.rollout.top_k}")
    if cfg.train.lora is not None:
        errors.append(f"{where} train.lora unset (adapter layers are not routed through the invariant linear)")
    return errors


def reuse_rollout_logprobs_errors(cfg: MilesConfig) -> list[str]:
    """``train.reuse_rollout_logprobs`` takes the rollout's log-probs for the trainer's own, which is
    exact only under ``rollout.true_on_policy`` (whose own errors name the engine, backend, device
    and sampling settings that break it)."""
    if not cfg.train.reuse_rollout_logprobs or cfg.rollout.true_on_policy:
        return []
    why = [f"rollout.engine {cfg.rollout.engine!r} computes its own forward"] if cfg.rollout.engine != "embedded" else []
    if cfg.train.backend != "fsdp":
        why.append(f"train.backend {cfg.train.backend!r} has no batch-invariant path")
    differs = "; ".join(why) or "the engine's kernels reduce in another order than the trainer's"
    return [f"train.reuse_rollout_logprobs: true needs rollout.true_on_policy: true: without it the rollout's "
            f"log-probs differ from the trainer's ({differs}; ~1e-5 on CPU fp32, ~1e-3 in bf16), and training on "
            f"them as the old policy would hide that gap; set rollout.true_on_policy: true, or "
            f"train.reuse_rollout_logprobs: false"]


def _spec_errors(cfg: MilesConfig, kernel: Kernel) -> list[str]:
    """What the chosen implementations' specs require of the rest of the config."""
    errors = []
    if cfg.algorithm.advantage in kernel.advantages():
        advantage = kernel.advantages().get(cfg.algorithm.advantage)
        if advantage.needs_critic and not cfg.train.use_critic:
            errors.append(
                f"algorithm.advantage {cfg.algorithm.advantage!r} needs a critic: set train.use_critic: true"
            )
        if advantage.policy_loss is not None and cfg.train.policy_loss != advantage.policy_loss:
            errors.append(
                f"algorithm.advantage {cfg.algorithm.advantage!r} needs train.policy_loss: {advantage.policy_loss}, got "
                f"{cfg.train.policy_loss!r}"
            )
    generators = kernel.generators()
    if cfg.rollout.generator in generators and generators.get(cfg.rollout.generator).needs_agent \
            and cfg.rollout.agent is None:
        errors.append(f"rollout.generator {cfg.rollout.generator!r} needs rollout.agent: the name of a registered agent")
    return errors + _engine_errors(cfg, kernel) + _role_errors(cfg, kernel)


def _role_errors(cfg: MilesConfig, kernel: Kernel) -> list[str]:
    """Every run starts a router in front of its engines, and the generator may need more (the
    session server for ``agentic``): a role no installed service has is an error here, before any
    process starts, rather than after the trainer and engines are up."""
    from miles_contracts.cluster import ROUTER

    generators = kernel.generators()
    if cfg.rollout.generator not in generators:
        return []
    needed = dict.fromkeys([ROUTER, *generators.get(cfg.rollout.generator).services])
    present = {e.obj.role for e in kernel.services().entries()}
    return [f"rollout.generator: {cfg.rollout.generator!r} needs a {role!r} service and none is installed; "
            f"{kernel.install_state.role_hint(role)}" for role in needed if role not in present]


def _engine_errors(cfg: MilesConfig, kernel: Kernel) -> list[str]:
    """``rollout.engine`` must name a service of role ``engine`` (not the router, say)."""
    from miles_contracts.cluster import ENGINE

    services = kernel.services()
    if cfg.rollout.engine not in services:
        return []
    role = services.get(cfg.rollout.engine).role
    if role == ENGINE:
        return []
    engines = [e.name for e in services.entries() if e.obj.role == ENGINE]
    return [f"rollout.engine: {cfg.rollout.engine!r} is a {role} service, not an engine; "
            f"engines: {', '.join(engines) or 'none installed (pip install miles-engine)'}"]


def _without_moved_keys(data: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``data`` without keys that moved (:data:`MOVED_KEYS`), and one error per such key naming
    where it lives now (rather than a bare "unknown key")."""
    out = dict(data)
    errors = []
    for old, new in MOVED_KEYS.items():
        section, key = old.split(".", 1)
        raw = out.get(section)
        if isinstance(raw, dict) and key in raw:
            errors.append(f"{old}: moved to {new}; write {new}: {raw[key]!r}")
            out[section] = {k: v for k, v in raw.items() if k != key}
    return out, errors


def build_config(data: Mapping[str, Any], *, source: str | None = None, kernel: Kernel | None = None,
                 check_names: bool = True) -> MilesConfig:
    """Validate raw config data. Raises :class:`ConfigError` listing every problem.

    :param check_names: also check every name that refers to a registry (``algorithm.advantage``,
        ``rollout.filters`` ...) and what the chosen specs require. The driver does; a service
        process started from the run's config (validated whole by the driver) leaves it out:
        collecting every registry imports every plugin's implementations (torch, for the advantage
        estimators: ~5 s more for a router to start), and a service resolves the names it uses
        itself, with the same errors.
    """
    from miles.kernel import Kernel

    errors: list[str] = []
    try:
        plugins = PluginsSection.model_validate(data.get("plugins") or {})
    except ValidationError as exc:
        raise ConfigError(_format_pydantic("plugins", exc, PluginsSection), source=source) from None
    if kernel is None:
        kernel = Kernel.load(PluginSelection.from_settings(plugins.enable, plugins.disable))
    extra_models = {e.name: e.obj.model for e in kernel.config_sections().entries()}
    clashes = sorted(set(extra_models) & set(CORE_SECTIONS))
    if clashes:
        errors += [f"{name}: a plugin registered a section that the kernel owns" for name in clashes]

    data, moved = _without_moved_keys(data)
    errors += moved
    known = [*CORE_SECTIONS, *extra_models]
    # A disabled plugin's section is left alone: ``plugins.disable: [x]`` turns x off without
    # having to delete its settings (its section is named after it by convention).
    switched_off = {info.name for info in kernel.plugins() if info.status != "loaded"}
    for name in data:
        if name not in known and name not in switched_off:
            hint = kernel.install_state.name_hint("config_section", name)
            if hint is None:
                close = closest_name(name, known)
                hint = (f"did you mean {close}? " if close else "") + f"known sections: {', '.join(known)}"
            errors.append(f"{name}: unknown section; {hint}")

    data = _with_default_train_backend(data, kernel)
    values: dict[str, BaseModel] = {}
    for name, model in {**extra_models, **CORE_SECTIONS}.items():
        raw = data.get(name)
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            errors.append(f"{name}: must be a mapping of keys, got {type(raw).__name__}")
            continue
        try:
            values[name] = model.model_validate(raw)
        except ValidationError as exc:
            errors += _format_pydantic(name, exc, model)

    if check_names:
        errors += _registry_errors(values, kernel)
    if errors:
        raise ConfigError(errors, source=source)

    core = {name: values[name] for name in CORE_SECTIONS}
    extra = {name: values[name] for name in extra_models}
    cfg = MilesConfig(**cast(dict[str, Any], core), extra=extra)  # each core section validated by its own model
    errors = _cross_section_errors(cfg) + (_spec_errors(cfg, kernel) if check_names else [])
    if errors:
        raise ConfigError(errors, source=source)
    return cfg


def load_config(path: Path | str | None = None, overrides: Sequence[str] = (), *, kernel: Kernel | None = None,
                check_names: bool = True) -> MilesConfig:
    """Load ``path`` (or, when None, the embedded default: the section defaults with
    :data:`miles.embedded_default.SETTINGS` on top), apply overrides, validate (see :func:`build_config`)."""
    from miles.embedded_default import raw_settings

    data = read_yaml(Path(path)) if path is not None else raw_settings()
    errors = apply_overrides(data, overrides)
    source = str(path) if path is not None else None
    if errors:
        raise ConfigError(errors, source=source)
    return build_config(data, source=source, kernel=kernel, check_names=check_names)


__all__ = [
    "AlgorithmSection",
    "ConfigError",
    "DataSection",
    "EvalSection",
    "ExecutorSection",
    "MilesConfig",
    "ModelSection",
    "PluginsSection",
    "RewardSection",
    "RolloutSection",
    "ResourcesSection",
    "RunSection",
    "TrackingSection",
    "TrainSection",
    "WeightsSection",
    "build_config",
    "load_config",
    "unresolved_names",
]
