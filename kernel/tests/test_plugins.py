"""Plugin discovery, blocking, allow-listing, validation and the registries' error messages."""

from __future__ import annotations

import pytest
from miles.errors import MilesDeprecationWarning, PluginError
from miles.kernel import Kernel
from miles.plugins import PluginSelection
from miles.registry import UnknownNameError
from miles_contracts import (
    ConfigSectionSpec,
    ForwardContext,
    GeneratorSpec,
    Process,
    RewardSpec,
    RunContext,
    ServiceSpec,
)

REWARD_PLUGIN = """
    from miles import hookimpl
    from miles_contracts import RewardSpec

    def shout(samples):
        return [1.0 for _ in samples]

    @hookimpl
    def miles_register_rewards(register):
        register("shout", RewardSpec(shout))
"""


def test_builtins_are_loaded_through_entry_points(fresh_kernels: None) -> None:
    infos = {i.name: i for i in Kernel.load().plugins()}
    assert infos["core"].distribution == "miles-kernel"
    assert infos["core"].status == "loaded"
    assert "miles_register_commands" in infos["core"].hooks


def test_external_plugin_registers_by_name_with_its_origin(extra_plugins) -> None:
    extra_plugins("shouty", REWARD_PLUGIN)
    kernel = Kernel.load()
    spec = kernel.rewards().get("shout")
    assert isinstance(spec, RewardSpec)
    assert spec.score([object(), object()]) == [1.0, 1.0]
    assert kernel.rewards().entry("shout").plugin == "shouty"


def test_a_bare_object_of_the_old_style_is_adapted_with_a_warning_naming_the_spec(extra_plugins) -> None:
    """Plugins written before specs keep working for one release: their capability attributes
    become the spec's fields, and the warning says what to register instead."""
    extra_plugins("old", """
        from miles import hookimpl

        def shout(samples):
            return [1.0 for _ in samples]

        def make_backend(config):
            return ("backend for", config)
        make_backend.weights_on_rank0 = True

        class Estimator:
            needs_critic = True
            policy_loss = "gspo"

            def __call__(self, batch, params):
                raise AssertionError("not called")

        @hookimpl
        def miles_register_rewards(register):
            register("shout", shout)

        @hookimpl
        def miles_register_train_backends(register):
            register("old_backend", make_backend)

        @hookimpl
        def miles_register_advantages(register):
            register("old_estimator", Estimator())
    """)
    kernel = Kernel.load()
    with pytest.warns(MilesDeprecationWarning, match="reward 'shout' as a bare function; register miles_contracts.RewardSpec"):
        reward = kernel.rewards().get("shout")
    assert reward.score([object()]) == [1.0]
    with pytest.warns(MilesDeprecationWarning, match="TrainBackendSpec.*weights_on_rank0 become spec fields"):
        backend = kernel.train_backends().get("old_backend")
    assert backend.weights_on_rank0 is True
    config = object()
    ctx = RunContext(config, kernel, Process.trainer_rank(0))  # type: ignore[arg-type]
    assert backend.create(ctx) == ("backend for", config)  # the old factory took the config
    with pytest.warns(MilesDeprecationWarning, match="AdvantageSpec"):
        estimator = kernel.advantages().get("old_estimator")
    assert (estimator.needs_critic, estimator.zero_sum_groups, estimator.policy_loss) == (True, False, "gspo")


def test_what_cannot_be_a_spec_is_refused_naming_the_spec(extra_plugins) -> None:
    extra_plugins("wrong", """
        from miles import hookimpl

        @hookimpl
        def miles_register_services(register):
            register("nothing", 42)
    """)
    with pytest.raises(PluginError, match="plugin 'wrong' registered service 'nothing' as a int.*ServiceSpec"):
        Kernel.load().services()


def test_specs_check_their_fields_when_the_plugin_registers() -> None:
    with pytest.raises(TypeError, match="RewardSpec.score must be callable"):
        RewardSpec(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="GeneratorSpec.services must be a tuple of non-empty names"):
        GeneratorSpec(lambda s, c: s, services="session")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="health_path must start with '/'"):
        ServiceSpec("engine", lambda launch: [], health_path="health")
    with pytest.raises(TypeError, match="pydantic model class"):
        ConfigSectionSpec(dict)  # type: ignore[arg-type]


def test_disable_blocks_before_loading(extra_plugins) -> None:
    extra_plugins("broken", "raise RuntimeError('must never be imported')")
    kernel = Kernel.load(PluginSelection(disable=("broken",)))
    assert {i.name: i.status for i in kernel.plugins()}["broken"] == "blocked"


def test_env_var_disables(extra_plugins, monkeypatch: pytest.MonkeyPatch) -> None:
    extra_plugins("shouty", REWARD_PLUGIN)
    monkeypatch.setenv("MILES_DISABLE_PLUGINS", "shouty, llama")
    kernel = Kernel.load(PluginSelection.from_settings(None, ()))
    assert "shout" not in kernel.rewards()
    assert {i.name: i.status for i in kernel.plugins()}["shouty"] == "blocked"


def test_enable_is_an_allow_list_that_keeps_essentials(extra_plugins) -> None:
    extra_plugins("shouty", REWARD_PLUGIN)
    kernel = Kernel.load(PluginSelection(enable=("shouty",)))
    statuses = {i.name: i.status for i in kernel.plugins()}
    assert statuses["shouty"] == "loaded"
    assert statuses["core"] == "loaded"  # essential
    assert all(status == "not enabled" for name, status in statuses.items() if name not in {"shouty", "core"})


def test_enable_unknown_plugin_lists_installed(fresh_kernels: None) -> None:
    with pytest.raises(PluginError, match="not installed: nope; installed: .*core"):
        Kernel.load(PluginSelection(enable=("nope",)))


@pytest.mark.parametrize("field", ["enable", "disable"])
def test_a_misspelled_plugin_name_is_refused_with_a_guess(fresh_kernels: None, field: str) -> None:
    # a misspelled disable is the dangerous one: the plugin the user meant to turn off would stay on
    with pytest.raises(PluginError) as info:
        Kernel.load(PluginSelection(**{field: ("lamma", "nosuch")}))
    message = str(info.value)
    assert f"plugins.{field} names plugin(s) that are not installed: lamma (did you mean 'llama'?), nosuch;" in message
    assert "installed: " in message and "core" in message and "qwen3" in message


def test_a_misspelled_name_in_the_env_var_is_refused_naming_the_variable(
        fresh_kernels: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_DISABLE_PLUGINS", "llama,qwen")
    with pytest.raises(PluginError, match=r"MILES_DISABLE_PLUGINS names plugin\(s\) that are not installed: "
                                          r"qwen \(did you mean 'qwen3'\?\); installed: "):
        Kernel.load(PluginSelection.from_settings(None, ["r3"]))


def test_every_name_problem_is_reported_at_once(fresh_kernels: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_DISABLE_PLUGINS", "nosuch_env")
    with pytest.raises(PluginError) as info:
        Kernel.load(PluginSelection.from_settings(["nosuch_enable"], ["core", "nosuch_disable"]))
    message = str(info.value)
    for part in ("core cannot be disabled", "plugins.enable names plugin(s) that are not installed: nosuch_enable",
                 "plugins.disable names plugin(s) that are not installed: nosuch_disable",
                 "MILES_DISABLE_PLUGINS names plugin(s) that are not installed: nosuch_env"):
        assert part in message


def test_a_plugin_whose_import_fails_is_installed_and_can_be_disabled_by_env(
        extra_plugins, monkeypatch: pytest.MonkeyPatch) -> None:
    extra_plugins("broken", "import definitely_not_a_module_xyz")
    monkeypatch.setenv("MILES_DISABLE_PLUGINS", "broken")
    kernel = Kernel.load(PluginSelection.from_settings(None, ()))
    assert {i.name: i.status for i in kernel.plugins()}["broken"] == "blocked"


def test_essential_plugin_cannot_be_disabled(fresh_kernels: None) -> None:
    with pytest.raises(PluginError, match="core cannot be disabled"):
        Kernel.load(PluginSelection(disable=("core",)))


def test_import_failure_names_plugin_and_fix(extra_plugins) -> None:
    extra_plugins("broken", "import definitely_not_a_module_xyz")
    with pytest.raises(PluginError) as info:
        Kernel.load()
    message = str(info.value)
    assert "plugin 'broken'" in message
    assert "ModuleNotFoundError" in message and "definitely_not_a_module_xyz" in message
    assert "MILES_DISABLE_PLUGINS=broken" in message


def test_misspelled_hook_fails_check_pending(extra_plugins) -> None:
    extra_plugins("typo", """
        from miles import hookimpl

        @hookimpl
        def miles_register_rewrds(register):
            pass
    """)
    with pytest.raises(PluginError, match="plugin 'typo'.*miles_register_rewrds"):
        Kernel.load()


def test_unknown_name_lists_choices_and_suggests(extra_plugins) -> None:
    extra_plugins("shouty", REWARD_PLUGIN)
    with pytest.raises(UnknownNameError) as info:
        Kernel.load().rewards().get("shoot")
    assert "unknown reward 'shoot'; registered:" in str(info.value)
    assert "shout (plugin shouty)" in str(info.value)
    assert "Did you mean 'shout'?" in str(info.value)


def test_duplicate_names_name_both_plugins(extra_plugins) -> None:
    extra_plugins("first", REWARD_PLUGIN)
    extra_plugins("second", REWARD_PLUGIN)
    with pytest.raises(PluginError, match="'shout' is registered twice: by plugin 'first'.*and by plugin 'second'"):
        Kernel.load().rewards()


def test_failing_register_hook_names_the_plugin(extra_plugins) -> None:
    extra_plugins("explodes", """
        from miles import hookimpl

        @hookimpl
        def miles_register_filters(register):
            raise ValueError("bad table")
    """)
    with pytest.raises(PluginError, match="plugin 'explodes'.*miles_register_filters: ValueError: bad table"):
        Kernel.load().filters()


def test_forward_wrappers_run_outermost_first_around_the_forward(extra_plugins) -> None:
    extra_plugins("outer", """
        from miles import hookimpl

        @hookimpl(wrapper=True)
        def miles_forward(ctx):
            ctx.state.setdefault("trace", []).append("outer-in")
            result = yield
            ctx.state["trace"].append("outer-out")
            return result * 10
    """)
    extra_plugins("inner", """
        from miles import hookimpl

        @hookimpl(wrapper=True)
        def miles_forward(ctx):
            ctx.state.setdefault("trace", []).append("inner-in")
            result = yield
            ctx.state["trace"].append("inner-out")
            return result + 1
    """)
    kernel = Kernel.load()
    ctx = ForwardContext(phase="train", model=None, batch=None, backend="test")  # type: ignore[arg-type]

    def forward() -> int:
        ctx.state["trace"].append("forward")
        return 4

    assert kernel.run_forward(ctx, forward) == 50
    assert ctx.state["trace"] == ["outer-in", "inner-in", "forward", "inner-out", "outer-out"]


def test_plain_forward_implementation_is_refused(extra_plugins) -> None:
    extra_plugins("plain", """
        from miles import hookimpl

        @hookimpl
        def miles_forward(ctx):
            return 1
    """)
    with pytest.raises(PluginError, match="'plain' implements miles_forward without wrapper=True"):
        Kernel.load()


def test_model_bridge_claim_and_clear_error_when_unclaimed(extra_plugins) -> None:
    extra_plugins("toy", """
        from miles import hookimpl

        class ToyBridge:
            name = "toy"
            chat_family = None

        @hookimpl
        def miles_model_bridge(hf_config):
            if "ToyForCausalLM" in hf_config.get("architectures", []):
                return ToyBridge()
            return None
    """)
    kernel = Kernel.load()
    assert kernel.model_bridge({"architectures": ["ToyForCausalLM"]}).name == "toy"
    with pytest.raises(PluginError, match="no model plugin recognises architecture MambaForCausalLM; installed model plugins: .*toy"):
        kernel.model_bridge({"architectures": ["MambaForCausalLM"]})


def test_load_is_idempotent_per_selection(fresh_kernels: None) -> None:
    assert Kernel.load() is Kernel.load()
    assert Kernel.load(PluginSelection(disable=("llama",))) is not Kernel.load()
