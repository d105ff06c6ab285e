"""Group filters, the filter pipeline and the over-sampling accounting."""

from __future__ import annotations

import pytest
from miles import hookimpl
from miles.builtin.filters import no_aborted, no_truncated, zero_variance
from miles.errors import PluginError
from miles.filtering import FilterResult, OverSampler, apply_filters, over_sampler_for
from miles.kernel import Kernel
from miles.plugins import PluginSelection, load_plugins
from miles.registry import Register, UnknownNameError
from miles_contracts import ExitReason, FilterSpec, FilterVerdict, Sample, Status
from miles_contracts.testing.filter import check_filter


def group(*rewards: float | None, statuses: tuple[Status, ...] | None = None, index: int = 0) -> list[Sample]:
    statuses = statuses or (Status.COMPLETED,) * len(rewards)
    return [Sample(reward=r, status=s, group_index=index, index=i) for i, (r, s) in enumerate(zip(rewards, statuses, strict=True))]


class FiltersForTests:
    @hookimpl
    def miles_register_filters(self, register: Register) -> None:
        register("crashes", FilterSpec(lambda g: 1 / 0))
        register("says_yes", FilterSpec(lambda g: True))


@pytest.fixture(scope="module")
def kernel() -> Kernel:
    selection = PluginSelection(enable=("filters",))
    kernel = Kernel(load_plugins(selection), selection)
    kernel.register_plugin(FiltersForTests(), "filters_for_tests")
    return kernel


def test_zero_variance() -> None:
    assert zero_variance(group(1.0, 0.0, 1.0)) == FilterVerdict(keep=True)
    assert zero_variance(group(1.0, 1.0, 1.0)) == FilterVerdict(keep=False, reason="zero_std")
    assert zero_variance(group(0.3, 0.3 + 1e-12)) == FilterVerdict(keep=False, reason="zero_std")  # float noise
    assert zero_variance(group(0.7)) == FilterVerdict(keep=False, reason="zero_std")
    assert zero_variance(group(1.0, None, 1.0)).keep is False  # unscored samples do not count
    assert zero_variance(group(1.0, None, 0.0)).keep is True


def test_no_aborted_and_no_truncated() -> None:
    mixed = group(1.0, None, 0.0, statuses=(Status.COMPLETED, Status.ABORTED, Status.FAILED))
    assert no_aborted(mixed) == FilterVerdict(keep=False, reason="aborted")
    assert no_aborted(group(1.0, None, statuses=(Status.COMPLETED, Status.FAILED))) == FilterVerdict(False, "failed")
    assert no_aborted(group(1.0, 0.0, statuses=(Status.COMPLETED, Status.TRUNCATED))).keep is True
    assert no_truncated(group(1.0, 0.0, statuses=(Status.COMPLETED, Status.TRUNCATED))) == FilterVerdict(False, "truncated")
    assert no_truncated(group(1.0, 0.0)).keep is True


@pytest.mark.parametrize("name", ["zero_variance", "no_aborted", "no_truncated"])
def test_registered_filters_conform(kernel: Kernel, name: str) -> None:
    check_filter(kernel.filters().get(name))


def test_conformance_suite_catches_a_mutating_filter() -> None:
    def clears_rewards(g):
        for s in g:
            s.reward = None
        return FilterVerdict(keep=True)

    with pytest.raises(AssertionError, match="modified the samples"):
        check_filter(clears_rewards)
    with pytest.raises(AssertionError, match="a drop needs a snake_case reason"):
        check_filter(lambda g: FilterVerdict(keep=False, reason="Zero STD!"))


def test_pipeline_first_drop_decides_and_counts_per_reason(kernel: Kernel) -> None:
    groups = [
        group(1.0, 0.0, index=0),  # kept
        group(1.0, 1.0, index=1),  # zero_std
        group(None, 1.0, statuses=(Status.ABORTED, Status.COMPLETED), index=2),  # aborted (first filter)
        group(0.0, 0.0, index=3),  # zero_std
        group(0.0, 1.0, index=4),  # kept
    ]
    result = apply_filters(groups, ["no_aborted", "zero_variance"], kernel)
    kept, drop_counts = result
    assert [g[0].group_index for g in kept] == [0, 4]
    assert drop_counts == {"zero_std": 2, "aborted": 1}  # group 2 counted once, by the first filter
    assert result.metrics() == {"filter/drop_zero_std": 2.0, "filter/drop_aborted": 1.0,
                                "filter/kept_groups": 2.0, "filter/dropped_groups": 3.0}
    assert apply_filters(groups, [], kernel).kept == groups


def test_pipeline_errors_name_the_filter(kernel: Kernel) -> None:
    with pytest.raises(PluginError, match=r"filter 'crashes' \(plugin filters_for_tests\) raised ZeroDivisionError on group 0"):
        apply_filters([group(1.0)], ["crashes"], kernel)
    with pytest.raises(PluginError, match="filter 'says_yes' .* returned True; a filter returns miles_contracts.FilterVerdict"):
        apply_filters([group(1.0)], ["says_yes"], kernel)
    with pytest.raises(UnknownNameError, match="unknown filter 'zero_varience'.*Did you mean 'zero_variance'"):
        apply_filters([group(1.0)], ["zero_varience"], kernel)


def test_over_sampler_starts_at_the_config_factor_and_learns_the_keep_rate() -> None:
    sampler = over_sampler_for(1.5)
    assert sampler.groups_to_draw(8) == 12  # 8 * 1.5 before anything is known
    sampler.observe(drawn=12, kept=3)  # keep rate 1/4
    assert sampler.keep_rate == 0.25
    assert sampler.groups_to_draw(8) == 32
    assert sampler.groups_to_draw(5) == 20  # a top-up round for the 5 still missing
    sampler.observe(drawn=20, kept=20)  # 0.5 * 1.0 + 0.5 * 0.25
    assert sampler.keep_rate == pytest.approx(0.625)
    assert sampler.groups_to_draw(8) == 13  # 8 / 0.625 = 12.8
    sampler.observe(drawn=13, kept=13)
    sampler.observe(drawn=13, kept=13)
    assert sampler.groups_to_draw(8) == 12  # never below the configured factor
    assert sampler.groups_to_draw(0) == 0


def test_over_sampler_is_bounded_and_resumable() -> None:
    sampler = OverSampler(factor=1.0)
    sampler.observe(drawn=10, kept=0)
    assert sampler.groups_to_draw(4) == 32  # max_factor 8 when nothing passes
    restored = OverSampler(factor=1.0)
    restored.load_state_dict(sampler.state_dict())
    assert restored.groups_to_draw(4) == 32
    assert over_sampler_for(1.0).groups_to_draw(4) == 4
    with pytest.raises(ValueError, match=r"kept \(5\) must be within \[0, drawn=4\]"):
        sampler.observe(drawn=4, kept=5)


def test_filter_result_of_nothing() -> None:
    assert FilterResult([], {}).metrics() == {"filter/kept_groups": 0.0, "filter/dropped_groups": 0.0}


def test_a_failed_reward_drops_the_group_under_the_default_filter(kernel: Kernel) -> None:
    failed = group(1.0, 0.0)
    failed[1].reward = None
    failed[1].finish(Status.FAILED, ExitReason.REWARD_ERROR, "boom")
    assert apply_filters([failed], ["no_aborted"], kernel).drop_counts == {"failed": 1}
