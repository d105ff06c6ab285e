"""The kernel's table of first-party plugins (``miles.install_hints``) against what the installed
workspace really registers, and the errors a user sees when a package is missing or switched off:
the package named, before any process starts."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from miles.cli.main import main
from miles.config import build_config
from miles.errors import ConfigError, PluginError
from miles.install_hints import FIRST_PARTY, SERVICE_ROLES, normalise
from miles.kernel import Kernel
from miles.kinds import KINDS
from miles.plugins import ENTRY_POINT_GROUP, PluginSelection

ROOT = Path(__file__).resolve().parents[1]


def _without(*plugins: str) -> Kernel:
    return Kernel.load(PluginSelection(disable=tuple(sorted(plugins))))


def test_the_table_lists_exactly_what_each_first_party_plugin_registers() -> None:
    kernel = Kernel.load(PluginSelection())
    registered = {(e.plugin, kind, e.name) for kind in KINDS for e in kernel.registry(kind).entries()}
    tabled = {(p.plugin, kind, name) for p in FIRST_PARTY for kind, names in p.names.items() for name in names}
    first_party = {p.plugin for p in FIRST_PARTY}
    assert {r for r in registered if r[0] in first_party} == tabled


def test_the_table_names_each_plugin_with_the_distribution_that_installs_it() -> None:
    installed = {ep.name: normalise(ep.dist.metadata["Name"]) for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)
                 if ep.dist is not None}
    members = set()
    for pattern in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["uv"]["workspace"]["members"]:
        members |= {tomllib.loads((p / "pyproject.toml").read_text())["project"]["name"]
                    for p in ROOT.glob(pattern) if (p / "pyproject.toml").is_file()}
    assert {p.plugin: p.distribution for p in FIRST_PARTY} == {name: d for name, d in installed.items() if d in members}


def test_service_roles_and_claimed_architectures_are_current() -> None:
    kernel = Kernel.load(PluginSelection())
    assert {e.name: e.obj.role for e in kernel.services().entries()} == SERVICE_ROLES
    for provider in (p for p in FIRST_PARTY if p.architectures):
        for arch in provider.architectures:
            config = {"model_type": arch} if arch.islower() else {"architectures": [arch]}
            assert kernel.find_model_bridge(config) is not None, arch
            assert _without(provider.plugin).find_model_bridge(config) is None, f"{arch} is claimed by another plugin"


def test_a_qwen3_moe_without_its_plugin_points_at_the_qwen3_package() -> None:
    with pytest.raises(PluginError) as info:
        _without("qwen3").model_bridge({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"})
    assert "Qwen3MoeForCausalLM: it comes with miles-model-qwen3, whose plugin 'qwen3' is installed but blocked" in str(info.value)
    assert "miles-model-llama" not in str(info.value)


def test_the_default_train_backend_is_the_installed_one() -> None:
    assert build_config({}, kernel=Kernel.load(PluginSelection())).train.backend == "fsdp"  # both: fsdp
    assert build_config({}, kernel=_without("fsdp")).train.backend == "megatron"  # megatron alone trains
    assert build_config({"train": {"lr": 1e-5}}, kernel=_without("fsdp")).train.backend == "megatron"
    # a value the config gives is kept, and checked
    with pytest.raises(ConfigError) as info:
        build_config({"train": {"backend": "fsdp"}}, kernel=_without("fsdp"))
    assert ("train.backend: unknown train backend 'fsdp': it comes with miles-fsdp, whose plugin 'fsdp' is installed "
            "but blocked (take it out of plugins.disable and MILES_DISABLE_PLUGINS); installed: megatron") in str(info.value)
    with pytest.raises(ConfigError, match="unknown train backend 'fsdp': it comes with miles-fsdp.*no train backend is installed"):
        build_config({}, kernel=_without("fsdp", "megatron"))


def test_a_config_naming_switched_off_packages_reports_each_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        build_config({"megatron": {"tensor_parallel": 1}}, kernel=_without("engine", "weights", "megatron"))
    off = "is installed but blocked (take it out of plugins.disable and MILES_DISABLE_PLUGINS)"
    v = metadata.version("miles-kernel")  # every member's version (lockstep)
    assert info.value.errors == [
        f"rollout.engine: unknown service 'embedded': it comes with miles-engine, whose plugin 'engine' {off}; "
        f"installed: router (miles-router {v}), sandbox (miles-sandbox {v}), sglang (miles-sglang {v}), session (miles-tito {v})",
        f"weights.transport: unknown weight transport 'shared_memory': it comes with miles-weights, whose plugin "
        f"'weights' {off}; installed: mooncake (miles-mooncake {v})",
    ]  # the switched-off plugin's own section is left alone (plugins.disable keeps its settings)


def test_config_show_prints_the_defaults_and_what_is_missing(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MILES_DISABLE_PLUGINS", "engine,router")
    assert main(["config", "show"]) == 2
    out = capsys.readouterr()
    assert "model:\n  name: smollm2-135m-instruct" in out.out and "engine: embedded" in out.out
    assert "rollout.engine: unknown service 'embedded': it comes with miles-engine, whose plugin 'engine'" in out.err
    assert "needs a 'router' service and none is installed; it comes with miles-router" in out.err


def test_a_command_of_a_missing_package_names_it(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MILES_DISABLE_PLUGINS", "models")
    assert main(["models", "list"]) == 2
    assert capsys.readouterr().err == ("error: `miles models list`: it comes with miles-models, whose plugin 'models' is "
                                       "installed but blocked (take it out of plugins.disable and MILES_DISABLE_PLUGINS)\n")


def test_routing_replay_without_the_moe_models_plugin_names_it(tiny_moe: Path) -> None:
    from miles.errors import MilesError
    from miles_r3.layer_map import layer_map_of_run

    kernel = _without("qwen3")
    config = build_config({"model": {"name": str(tiny_moe)}, "r3": {"enabled": True}}, kernel=kernel)
    with pytest.raises(MilesError, match="routing replay needs the MoE layer map of .*Qwen3MoeForCausalLM: it comes "
                                         "with miles-model-qwen3, whose plugin 'qwen3' is installed but blocked"):
        layer_map_of_run(config, kernel)
