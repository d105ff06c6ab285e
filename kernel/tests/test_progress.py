"""The console of ``miles train``: the rollout bar says when and why over-sampling grew its total,
and the step line names what its tokens per second count.

The rollout runs the real RolloutManager, data source, rewards and filter pipeline; the generator
is a test plugin that answers at once (no engine: this is about what the bar shows, not
generation; tests/test_train_e2e.py runs real engines)."""

from __future__ import annotations

import asyncio
import io

from miles import hookimpl
from miles.config import MilesConfig
from miles.context import context_for
from miles.data.source import open_data_source
from miles.kernel import Kernel
from miles.loop.progress import Progress, RolloutProgress
from miles.loop.rollout import RolloutManager
from miles.plugins import PluginSelection
from miles.sections import RolloutSection
from miles_contracts import ExitReason, FilterSpec, FilterVerdict, GeneratorSpec, Sample, Status


async def instant(sample: Sample, ctx: object) -> Sample:
    sample.tokens, sample.response_length, sample.loss_mask = [1, 2, 3], 1, [1]
    sample.response, sample.weight_versions = "4", [0]
    return sample.finish(Status.COMPLETED, ExitReason.STOP)


def drops_the_first_two_groups(group: list[Sample]) -> FilterVerdict:
    return FilterVerdict(keep=group[0].group_index >= 2, reason="first_two")


class Workload:
    @hookimpl
    def miles_register_generators(self, register):
        register("instant", GeneratorSpec(instant))

    @hookimpl
    def miles_register_filters(self, register):
        register("drops_the_first_two_groups", FilterSpec(drops_the_first_two_groups))


def test_the_bar_says_when_over_sampling_and_a_top_up_round_grow_its_total(fresh_kernels: None) -> None:
    kernel = Kernel.load(PluginSelection(enable=("core", "data", "filters", "generators", "rewards")))
    kernel.register_plugin(Workload(), "workload")
    config = MilesConfig(rollout=RolloutSection(generator="instant", prompts_per_step=2, samples_per_prompt=2,
                                                over_sampling=1.5, filters=["drops_the_first_two_groups"]))
    ctx = context_for(config, kernel=kernel)
    manager = RolloutManager(ctx, open_data_source(ctx), engine=None, tokenizer=None)
    log = io.StringIO()  # not a TTY: lines, as in a log file
    progress = Progress(total_steps=3, stream=log)

    rollout = asyncio.run(manager.collect(1, progress=lambda p: progress.rollout(1, p)))

    assert len(rollout.groups) == 2 and rollout.metrics["rollout/groups_generated"] == 6.0
    shown = [line.split("] ", 1)[1] for line in log.getvalue().splitlines()]
    assert shown == [
        # round 1 draws 3 groups for the 2 the step trains on (rollout.over_sampling 1.5) ...
        "0/6 samples (over-sampling: 3 groups drawn for 2)",
        "6/6 samples (over-sampling: 3 groups drawn for 2)",
        # ... the filters keep 1: a top-up round grows the total from 6 to 12, and says so as it starts
        "6/12 samples (top-up round 2: the filters kept 1/2 groups, 6 drawn)",
        "12/12 samples (top-up round 2: the filters kept 1/2 groups, 6 drawn)",
    ]


def test_a_step_drawing_only_what_it_trains_on_has_no_note() -> None:
    assert RolloutProgress(done=3, total=8, round=1, groups_drawn=2, groups_wanted=2).note == ""
    out = io.StringIO()
    Progress(total_steps=4, stream=out).rollout(2, RolloutProgress(done=8, total=8, groups_drawn=2, groups_wanted=2))
    assert out.getvalue().rstrip().endswith("] 8/8 samples")


def test_the_step_line_says_its_tokens_per_second_are_generated_tokens() -> None:
    out = io.StringIO()
    Progress(total_steps=4, stream=out).step(1, {"perf/rollout_tokens_per_s": 123.45, "time/rollout": 2.0})
    assert "| 123.5 generated tok/s |" in out.getvalue()


def test_the_end_of_a_run_says_how_the_reward_moved_from_its_first_steps_to_its_last() -> None:
    """One step's reward is the mean of a few samples and jumps about; the closing line averages a
    third of the steps (3 at most) at each end, so a run that learned reads as one."""
    progress = Progress(total_steps=10, stream=io.StringIO())
    assert progress.reward_trend() is None
    for step, reward in enumerate([0.25, 0.0625, 0.3125, 0.5, 0.25, 0.75, 0.5, 0.75, 0.875, 0.625], start=1):
        progress.step(step, {"rollout/reward_mean": reward})
    assert progress.reward_trend() == "rollout reward (mean): steps 1-3 0.208 -> steps 8-10 0.750"

    short = Progress(total_steps=2, stream=io.StringIO())
    short.step(1, {"rollout/reward_mean": 0.5})
    assert short.reward_trend() is None  # one step has no trend
    short.step(2, {"rollout/reward_mean": float("nan")})  # no reward scored this step
    assert short.reward_trend() is None
