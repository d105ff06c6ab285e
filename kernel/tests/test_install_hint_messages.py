"""What an error says when a name's package is missing: the package and how to get it, whether it
is not installed or installed but switched off (the hook nobody implements is not the user's
concern)."""

from __future__ import annotations

from miles.install_hints import InstallState
from miles.registry import Entry, Registry

NOTHING = InstallState()


def test_a_name_of_a_package_that_is_not_installed_names_the_install_command() -> None:
    assert NOTHING.name_hint("train_backend", "fsdp") == "it comes with miles-fsdp, which is not installed (pip install miles-fsdp)"
    assert NOTHING.name_hint("service", "embedded") == "it comes with miles-engine, which is not installed (pip install miles-engine)"
    assert NOTHING.name_hint("weight_transport", "shared_memory") == (
        "it comes with miles-weights, which is not installed (pip install miles-weights)")
    assert NOTHING.name_hint("train_backend", "deepspeed") is None  # not a first-party name: no guess


def test_an_installed_but_switched_off_plugin_is_named_with_the_setting_to_change() -> None:
    blocked = InstallState(switched_off={"fsdp": "blocked"})
    assert blocked.name_hint("train_backend", "fsdp") == (
        "it comes with miles-fsdp, whose plugin 'fsdp' is installed but blocked "
        "(take it out of plugins.disable and MILES_DISABLE_PLUGINS)")
    allow_list = InstallState(switched_off={"generators": "not enabled"})
    assert allow_list.name_hint("generator", "single_turn") == (
        "it comes with miles-kernel, whose plugin 'generators' is installed but not enabled (add it to plugins.enable)")
    assert InstallState(loaded=frozenset({"fsdp"})).name_hint("train_backend", "fsdp") is None


def test_roles_models_and_commands_name_their_packages() -> None:
    assert NOTHING.role_hint("router") == "it comes with miles-router, which is not installed (pip install miles-router)"
    assert NOTHING.role_hint("engine") == ("it comes with miles-engine, which is not installed (pip install miles-engine), "
                                           "or with miles-sglang, which is not installed (pip install miles-sglang)")
    # a Qwen3-MoE checkpoint points at the Qwen3 plugin, not at the Llama one
    hint = InstallState(loaded=frozenset({"llama"})).model_hint(["Qwen3MoeForCausalLM", "qwen3_moe"])
    assert hint == ("Qwen3MoeForCausalLM: it comes with miles-model-qwen3, which is not installed "
                    "(pip install miles-model-qwen3)")
    assert NOTHING.model_hint(["MambaForCausalLM"]) is None
    assert NOTHING.command_hint(["models", "list"], {"train", "plugins", "config show"}) == (
        "`miles models list`: it comes with miles-models, which is not installed (pip install miles-models)")
    assert NOTHING.command_hint(["models"], set()) == (
        "`miles models`: it comes with miles-models, which is not installed (pip install miles-models)")
    assert NOTHING.command_hint(["bench", "r3"], {"bench engine"}) == (
        "`miles bench r3`: it comes with miles-r3, which is not installed (pip install miles-r3)")
    assert NOTHING.command_hint(["train", "run.steps=2"], {"train"}) is None
    assert NOTHING.command_hint(["nosuch"], {"train"}) is None  # argparse's own error then


def test_registry_errors_name_the_package_and_what_is_installed() -> None:
    state = InstallState(loaded=frozenset({"megatron"}))
    registry: Registry[object] = Registry("train backend", "miles_register_train_backends", install=state.kind_hint("train_backend"),
                                          name_hint=lambda name: state.name_hint("train_backend", name))
    registry.add(Entry("megatron", object(), "megatron", "miles-megatron", "0.1.0"))
    assert registry.unknown_message("fsdp") == (
        "unknown train backend 'fsdp': it comes with miles-fsdp, which is not installed (pip install miles-fsdp); "
        "installed: megatron (miles-megatron 0.1.0)")
    assert registry.unknown_message("megatorn") == (
        "unknown train backend 'megatorn'; registered: megatron (miles-megatron 0.1.0). Did you mean 'megatron'?")
    empty: Registry[object] = Registry("train backend", "miles_register_train_backends",
                                       install=NOTHING.kind_hint("train_backend"))
    message = empty.unknown_message("mine")
    assert message == "unknown train backend 'mine': no train backend is installed; pip install miles-fsdp or miles-megatron"
    assert "miles_register" not in message
