"""Which package to install for a name that nothing loaded provides.

A config names implementations (``train.backend: fsdp``, ``rollout.engine: embedded``), a run needs
services by role (a router), a model needs a bridge, and the command line names commands
(``miles models list``). When no loaded plugin provides one, the error says which package does
and whether it is missing or switched off -- ``pip install miles-fsdp`` -- rather than which hook
nobody implements.

:data:`FIRST_PARTY` names the first-party plugins and what each registers, as strings: the kernel
imports none of them (``import miles`` stays free of torch). ``tests/test_install_hints.py``
checks it against what the installed workspace really registers, so a name a package adds or
drops fails CI until this table follows.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Provider:
    """One first-party plugin (an entry point of the ``miles`` group) and what it registers.

    :ivar plugin: the entry-point name (what ``plugins.disable`` takes).
    :ivar distribution: the package that installs it.
    :ivar names: registry kind -> the names it registers there.
    :ivar architectures: ``config.json`` ``architectures`` / ``model_type`` values its bridge claims.
    """

    plugin: str
    distribution: str
    names: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    architectures: tuple[str, ...] = ()


def _row(plugin: str, distribution: str, *, architectures: tuple[str, ...] = (), **names: tuple[str, ...]) -> Provider:
    return Provider(plugin, distribution, names, architectures)


KERNEL = "miles-kernel"

FIRST_PARTY: tuple[Provider, ...] = (
    _row("core", KERNEL, command=("plugins", "config show")),
    _row("train", KERNEL, command=("train", "replay", "rollout", "ledger", "chaos")),
    _row("view", KERNEL, command=("view",)),
    _row("data", KERNEL, data_source=("jsonl", "parquet", "hf_dataset", "arithmetic")),
    _row("executors", KERNEL, executor=("local",)),
    _row("filters", KERNEL, filter=("zero_variance", "no_aborted", "no_truncated")),
    _row("generators", KERNEL, generator=("single_turn",)),
    _row("rewards", KERNEL, reward=("exact_match", "f1", "remote")),
    _row("trackers", KERNEL, tracker=("jsonl",)),
    _row("algorithms", "miles-algorithms", advantage=("grpo", "gspo", "ppo", "reinforce_pp", "reinforce_pp_baseline"),
         policy_loss=("ppo_clip", "gspo", "cispo"), mismatch_correction=("none", "tis", "mis")),
    _row("models", "miles-models", command=("models pull", "models list")),
    _row("engine", "miles-engine", service=("embedded",), config_section=("engine",),
         command=("serve engine", "bench engine")),
    _row("router", "miles-router", service=("router",), router_middleware=("metrics", "access_log", "concurrency_limit"),
         config_section=("router",), command=("serve router", "bench rollout-path")),
    _row("weights", "miles-weights", weight_transport=("shared_memory", "disk", "broadcast", "sglang_lora"),
         config_section=("weight_transport",), command=("bench weights", "weights cleanup")),
    _row("fsdp", "miles-fsdp", train_backend=("fsdp",), config_section=("fsdp",), command=("bench train",)),
    _row("megatron", "miles-megatron", train_backend=("megatron",), config_section=("megatron",)),
    _row("llama", "miles-model-llama", chat_family=("chatml",), architectures=("LlamaForCausalLM", "llama")),
    _row("qwen3", "miles-model-qwen3", chat_family=("qwen3",),
         architectures=("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "qwen3", "qwen3_moe")),
    _row("tito", "miles-tito", generator=("multi_turn", "agentic"), tool=("calculator",), service=("session",),
         config_section=("tito",), command=("serve session", "verify-template", "bench session", "bench tito", "bench isolation",
                                             "bench episode-tokens", "bench conformance")),
    _row("r3", "miles-r3", config_section=("r3",), command=("bench r3",)),
    _row("sglang", "miles-sglang", service=("sglang",), config_section=("sglang",)),
    _row("mooncake", "miles-mooncake", weight_transport=("mooncake",), config_section=("mooncake",)),
    _row("ray", "miles-ray", executor=("ray",), config_section=("ray",)),
    _row("rm_math", "miles-rm-math", reward=("math",)),
    _row("tensorboard", "miles-tracker-tensorboard", tracker=("tensorboard",)),
    _row("wandb", "miles-tracker-wandb", tracker=("wandb",), config_section=("wandb",)),
    _row("mlflow", "miles-tracker-mlflow", tracker=("mlflow",), config_section=("mlflow",)),
    _row("prometheus", "miles-tracker-prometheus", tracker=("prometheus",), config_section=("prometheus",)),
    _row("longtail", "miles-longtail", agent=("long_tail",), reward=("repeated_tokens",), config_section=("longtail",),
         command=("bench async",)),
    _row("sandbox", "miles-sandbox", agent=("mini_swe_agent",), reward=("swe_tests",), service=("sandbox",),
         config_section=("sandbox",), command=("serve sandbox", "bench sandbox")),
    _row("verifiers", "miles-verifiers", agent=("verifiers",), data_source=("verifiers",), reward=("verifiers",),
         config_section=("verifiers",)),
    _row("openenv", "miles-openenv", agent=("openenv",), data_source=("openenv",), reward=("openenv",),
         config_section=("openenv",)),
    _row("calculator-agent", "miles-example-calculator-agent", agent=("calculator_agent",)),
    _row("compacting-agent", "miles-example-compacting-agent", agent=("compacting_agent",)),
    _row("delegating-agent", "miles-example-delegating-agent", agent=("delegating_agent",)),
    _row("solver-verifier", "miles-example-solver-verifier", agent=("solver_verifier",), reward=("solver_verifier",)),
)
"""Every first-party plugin, the kernel's built-ins first."""

SERVICE_ROLES: dict[str, str] = {"embedded": "engine", "sglang": "engine", "router": "router", "session": "session",
                                 "sandbox": "sandbox"}
"""The role (``miles_contracts.cluster``) of each first-party service."""


def normalise(distribution: str) -> str:
    """PEP 503 form of a distribution name (``Miles_FSDP`` and ``miles-fsdp`` are one)."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


def providers_of(kind: str, name: str) -> list[Provider]:
    return [p for p in FIRST_PARTY if name in p.names.get(kind, ())]


@dataclass(frozen=True, slots=True)
class InstallState:
    """The plugins of this process: which loaded, and which are installed but switched off.

    :ivar loaded: names of the loaded plugins.
    :ivar switched_off: plugin name -> its status (``blocked`` or ``not enabled``) for plugins
        that are installed but not loaded.
    """

    loaded: frozenset[str] = frozenset()
    switched_off: Mapping[str, str] = field(default_factory=dict)

    def why_missing(self, provider: Provider) -> str | None:
        """``"miles-fsdp, which is not installed (pip install miles-fsdp)"``, or why its installed
        plugin is off; None when the plugin is loaded."""
        if provider.plugin in self.loaded:
            return None
        status = self.switched_off.get(provider.plugin)
        if status is None:
            return f"{provider.distribution}, which is not installed (pip install {provider.distribution})"
        fix = ("add it to plugins.enable" if status == "not enabled"
               else "take it out of plugins.disable and MILES_DISABLE_PLUGINS")
        return f"{provider.distribution}, whose plugin {provider.plugin!r} is installed but {status} ({fix})"

    def _comes_with(self, providers: list[Provider]) -> str | None:
        reasons = [why for p in providers if (why := self.why_missing(p))]
        return "it comes with " + ", or with ".join(reasons) if reasons else None

    def name_hint(self, kind: str, name: str) -> str | None:
        """Where the first-party ``name`` of ``kind`` comes from, when its plugin is not loaded."""
        return self._comes_with(providers_of(kind, name))

    def kind_hint(self, kind: str) -> str:
        """What to install for any implementation of ``kind`` (when none is registered)."""
        distributions = dict.fromkeys(p.distribution for p in FIRST_PARTY if p.names.get(kind) and p.distribution != KERNEL)
        if not distributions:
            return "install a package that registers one"
        return "pip install " + " or ".join(distributions)

    def role_hint(self, role: str) -> str:
        """Where a service of ``role`` comes from, for a run that needs one and has none."""
        services = [name for name, r in SERVICE_ROLES.items() if r == role]
        providers = [p for name in services for p in providers_of("service", name)]
        return self._comes_with(providers) or "install a package that registers one"

    def model_hint(self, architectures: list[str]) -> str | None:
        """Which model plugin claims one of ``architectures`` (``architectures`` and ``model_type``
        values of a ``config.json``), when it is not loaded."""
        for arch in architectures:
            hint = self._comes_with([p for p in FIRST_PARTY if arch in p.architectures])
            if hint:
                return f"{arch}: {hint}"
        return None

    def command_hint(self, words: list[str], registered: set[str]) -> str | None:
        """For the command line's leading ``words`` naming a first-party command that is not
        registered here: which package adds it."""
        for n in (2, 1):
            wanted = " ".join(words[:n])
            if len(words) < n or any(c == wanted or c.startswith(wanted + " ") for c in registered):
                continue
            providers = [p for p in FIRST_PARTY
                         if any(c == wanted or c.startswith(wanted + " ") for c in p.names.get("command", ()))]
            hint = self._comes_with(providers)
            if hint:
                return f"`miles {wanted}`: {hint}"
        return None
