"""Typed config: YAML + overrides, plugin sections, registry names, every error at once."""

from __future__ import annotations

from pathlib import Path

import pytest
from miles import hookimpl
from miles.config import MilesConfig, load_config
from miles.errors import ConfigError
from miles.kernel import Kernel
from miles.plugins import PluginSelection
from miles_contracts import (
    AdvantageSpec,
    ConfigSectionSpec,
    CorrectionSpec,
    DataSourceSpec,
    ExecutorSpec,
    FilterSpec,
    GeneratorSpec,
    PolicyLossSpec,
    RewardSpec,
    ServiceSpec,
    TrackerSpec,
    TrainBackendSpec,
    WeightTransportSpec,
)
from pydantic import BaseModel, ConfigDict


class ToyOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    depth: int = 2
    label: str = "x"


def _unused(*args: object, **kwargs: object) -> object:
    raise AssertionError("config validation must not call an implementation")


class DefaultsPlugin:
    """Registers every name the default config refers to, plus a plugin config section.

    The implementations are placeholders: these tests exercise config validation only, and the
    real implementations live in other packages with their own tests.
    """

    @hookimpl
    def miles_register_config_sections(self, register):
        register("toy", ConfigSectionSpec(ToyOptions))

    @hookimpl
    def miles_register_data_sources(self, register):
        register("arithmetic", DataSourceSpec(_unused))
        register("jsonl", DataSourceSpec(_unused))

    @hookimpl
    def miles_register_generators(self, register):
        register("single_turn", GeneratorSpec(_unused))

    @hookimpl
    def miles_register_services(self, register):
        register("embedded", ServiceSpec("engine", _unused))
        register("router", ServiceSpec("router", _unused))  # every run starts one

    @hookimpl
    def miles_register_filters(self, register):
        register("no_aborted", FilterSpec(_unused))
        register("zero_variance", FilterSpec(_unused))

    @hookimpl
    def miles_register_rewards(self, register):
        register("exact_match", RewardSpec(_unused))

    @hookimpl
    def miles_register_advantages(self, register):
        register("grpo", AdvantageSpec(_unused))
        register("ppo", AdvantageSpec(_unused, needs_critic=True))

    @hookimpl
    def miles_register_policy_losses(self, register):
        register("ppo_clip", PolicyLossSpec(_unused))

    @hookimpl
    def miles_register_mismatch_corrections(self, register):
        register("none", CorrectionSpec(_unused))
        register("tis", CorrectionSpec(_unused))

    @hookimpl
    def miles_register_train_backends(self, register):
        register("fsdp", TrainBackendSpec(_unused))

    @hookimpl
    def miles_register_weight_transports(self, register):
        register("shared_memory", WeightTransportSpec(_unused))

    @hookimpl
    def miles_register_trackers(self, register):
        register("jsonl", TrackerSpec(_unused))

    @hookimpl
    def miles_register_executors(self, register):
        register("local", ExecutorSpec(_unused))


@pytest.fixture
def kernel(fresh_kernels: None) -> Kernel:
    kernel = Kernel.load(PluginSelection(enable=()))  # only essential plugins
    kernel.register_plugin(DefaultsPlugin(), name="defaults")
    return kernel


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_defaults_validate(kernel: Kernel) -> None:
    cfg = load_config(None, kernel=kernel)
    assert isinstance(cfg, MilesConfig)
    assert cfg.model.name == "smollm2-135m-instruct"
    assert cfg.section("toy", ToyOptions).depth == 2


def test_yaml_and_overrides(kernel: Kernel, tmp_path: Path) -> None:
    path = write(tmp_path, "rollout:\n  temperature: 0.5\ntoy:\n  depth: 3\n")
    cfg = load_config(path, ["rollout.temperature=0.9", "toy.label=hello", "run.steps=7"], kernel=kernel)
    assert cfg.rollout.temperature == 0.9
    assert cfg.run.steps == 7
    assert cfg.section("toy", ToyOptions) == ToyOptions(depth=3, label="hello")


def test_every_error_is_reported_at_once_with_its_path(kernel: Kernel, tmp_path: Path) -> None:
    path = write(tmp_path, """
rollout:
  temperature: -1
  tempreature: 0.3
algorithm:
  advantage: grpoo
toy:
  depth: deep
mystery: {}
""")
    with pytest.raises(ConfigError) as info:
        load_config(path, kernel=kernel)
    errors = info.value.errors
    text = str(info.value)
    assert len(errors) == 5, text
    assert any(e.startswith("rollout.temperature: Input should be greater than or equal to 0") for e in errors)
    assert any(e.startswith("rollout.tempreature: unknown key") for e in errors)
    assert any(e.startswith("toy.depth: Input should be a valid integer") for e in errors)
    assert any(e.startswith("mystery: unknown section; known sections:") and "toy" in e for e in errors)
    assert any("algorithm.advantage: unknown advantage estimator 'grpoo'; registered: grpo" in e and "Did you mean 'grpo'" in e for e in errors)
    assert str(path) in text


def test_registry_names_are_checked_inside_lists(kernel: Kernel) -> None:
    with pytest.raises(ConfigError, match="rollout.filters: unknown filter 'zero_varience'"):
        load_config(None, ["rollout.filters=[no_aborted, zero_varience]"], kernel=kernel)


def test_a_vanishing_temperature_is_refused_with_the_greedy_spelling(kernel: Kernel) -> None:
    with pytest.raises(ConfigError, match="temperature 1e-300 is below 1e-6.*use 0 for greedy"):
        load_config(None, ["rollout.temperature=1e-300"], kernel=kernel)
    assert load_config(None, ["rollout.temperature=0"], kernel=kernel).rollout.temperature == 0.0


def test_cross_section_conflicts_say_how_to_fix(kernel: Kernel) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["algorithm.kl_loss_coef=0.1", "algorithm.advantage=ppo"], kernel=kernel)
    text = str(info.value)
    assert "set train.use_reference: true" in text
    assert "'ppo' needs a critic: set train.use_critic: true" in text


def test_malformed_override(kernel: Kernel) -> None:
    with pytest.raises(ConfigError, match="override 'rollout': expected section.key=value"):
        load_config(None, ["rollout"], kernel=kernel)


def test_unreadable_and_non_mapping_files(kernel: Kernel, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml", kernel=kernel)
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"), kernel=kernel)
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "a: [\n"), kernel=kernel)


def test_resolved_config_round_trips(kernel: Kernel, tmp_path: Path) -> None:
    cfg = load_config(None, ["rollout.max_new_tokens=32"], kernel=kernel)
    again = load_config(write(tmp_path, cfg.to_yaml()), kernel=kernel)
    assert again.to_dict() == cfg.to_dict()


def test_plugins_section_selects_plugins(fresh_kernels: None, tmp_path: Path) -> None:
    path = write(tmp_path, "plugins:\n  enable: []\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    # with only essential plugins nothing registers a generator: the error says which plugin would
    assert ("rollout.generator: unknown generator 'single_turn': it comes with miles-kernel, whose plugin "
            "'generators' is installed but not enabled (add it to plugins.enable); no generator is installed") in str(info.value)


def test_async_settings_are_checked_against_the_mode(kernel: Kernel) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["weights.update_interval=2", "rollout.max_staleness=1"], kernel=kernel)
    assert "weights.update_interval (2) applies to run.mode fully_async only" in str(err.value)
    assert "rollout.max_staleness (1) applies to run.mode fully_async only" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["run.mode=fully_async", "rollout.concurrency=2", "rollout.samples_per_prompt=4"], kernel=kernel)
    assert "rollout.concurrency (2) must be at least rollout.samples_per_prompt (4)" in str(err.value)
    assert "set algorithm.correction: tis (or mis)" in str(err.value)
    cfg = load_config(None, ["run.mode=fully_async", "algorithm.correction=tis", "rollout.max_staleness=2",
                             "weights.update_interval=2"], kernel=kernel)
    assert (cfg.run.mode, cfg.rollout.max_staleness, cfg.weights.update_interval) == ("fully_async", 2, 2)


def test_an_importance_correction_is_required_wherever_staleness_can_be_above_0(kernel: Kernel) -> None:
    """Collected with the other errors, naming the settings that make the run train on older
    weights' tokens. sync, and fully_async at max_staleness 0 (no group in flight across a push),
    train only on their own weights' tokens and need none."""
    stale = {
        ("run.mode=one_step_off",): "run.mode one_step_off trains each step on samples of the weights one update older",
        ("run.mode=fully_async",): "run.mode fully_async with rollout.max_staleness unset (no bound)",
        ("run.mode=fully_async", "rollout.max_staleness=2"): "run.mode fully_async with rollout.max_staleness 2",
    }
    for overrides, why in stale.items():
        with pytest.raises(ConfigError) as err:
            load_config(None, [*overrides, "rollout.max_new_tokens=2000"], kernel=kernel)
        message = str(err.value)
        assert "found 2 error(s)" in message and "rollout.max_new_tokens (2000)" in message  # collected at once
        assert f"algorithm.correction is none, but {why}" in message
        assert "set algorithm.correction: tis (or mis)" in message
        assert load_config(None, [*overrides, "algorithm.correction=tis"], kernel=kernel).algorithm.correction == "tis"
    for fine in ([], ["run.mode=fully_async", "rollout.max_staleness=0", "rollout.late_groups=recycle"]):
        assert load_config(None, fine, kernel=kernel).algorithm.correction == "none"
    with pytest.raises(ConfigError, match=r"rollout.late_groups \(recycle\) applies to run.mode fully_async only"):
        load_config(None, ["rollout.late_groups=recycle"], kernel=kernel)


def test_a_service_checks_the_schema_but_leaves_the_names_to_the_driver(kernel: Kernel) -> None:
    """check_names=False (what a service process started from the run's config uses) validates
    every section's keys and values, and skips what needs the registries (the driver did that)."""
    config = load_config(None, ["algorithm.advantage=made_up", "rollout.filters=[nope]"], kernel=kernel,
                         check_names=False)
    assert config.algorithm.advantage == "made_up"
    with pytest.raises(ConfigError, match="rollout.tempreature: unknown key"):
        load_config(None, ["rollout.tempreature=0.5"], kernel=kernel, check_names=False)
    with pytest.raises(ConfigError, match="unknown advantage estimator 'made_up'"):
        load_config(None, ["algorithm.advantage=made_up"], kernel=kernel)


def test_releasing_engine_memory_is_refused_where_nothing_could_use_it(kernel: Kernel) -> None:
    """resources.release_engine_memory needs a trainer on the engines' GPUs (colocated) and a mode
    in which rollout and training take turns; each conflict names itself and the fix."""
    assert load_config(None, ["resources.release_engine_memory=all"], kernel=kernel).resources.release_engine_memory == "all"
    for mode in ("one_step_off", "fully_async"):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"run.mode={mode}", "algorithm.correction=tis", "resources.release_engine_memory=kv_cache"],
                        kernel=kernel)
        assert (f"resources.release_engine_memory (kv_cache) needs rollout and training to take turns (run.mode sync), "
                f"but run.mode {mode} generates while the trainer trains") in str(err.value)
        assert "use run.mode: sync, or resources.release_engine_memory: none" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["resources.colocate=false", "resources.release_engine_memory=all"], kernel=kernel)
    assert "resources.colocate is false" in str(err.value) and "set resources.release_engine_memory: none" in str(err.value)
    with pytest.raises(ConfigError, match="release_engine_memory: Input should be 'none', 'kv_cache' or 'all'"):
        load_config(None, ["resources.release_engine_memory=weights"], kernel=kernel)
