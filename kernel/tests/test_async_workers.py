"""Rollout workers feeding the buffer (fully_async), on the kernel's own data source, rewards and
filter pipeline. The generator is a test plugin that answers at once: these tests are about the
wiring between workers, buffer and trainer, not about engines (tests/test_fully_async.py runs
the real ones)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from miles import hookimpl
from miles.config import MilesConfig
from miles.context import context_for
from miles.data.source import open_data_source
from miles.errors import PluginError
from miles.kernel import Kernel
from miles.loop.buffer import GroupBuffer
from miles.loop.modes.fully_async import filter_pipeline
from miles.loop.producer import LaunchPacing, RolloutWorkers
from miles.loop.rollout import RolloutManager
from miles.plugins import PluginSelection
from miles.sections import AlgorithmSection, RewardSection, RolloutSection, RunSection
from miles_contracts import ExitReason, FilterSpec, FilterVerdict, GeneratorSpec, RewardSpec, Sample, Status


async def instant(sample: Sample, ctx: object) -> Sample:
    sample.tokens, sample.response_length, sample.loss_mask = [1, 2, 3], 1, [1]
    sample.response = "4"  # no engine version reported: a group is as old as its launch
    return sample.finish(Status.COMPLETED, ExitReason.STOP)


def breaks_on_group_2(group: list[Sample]) -> FilterVerdict:
    if group[0].group_index == 2:
        raise RuntimeError("the filter has a bug")
    return FilterVerdict(keep=True)


class SlowReward:
    """A reward that answers only once ``release`` is set (``calls``: samples it was asked to score)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls = 0

    async def __call__(self, samples: list[Sample]) -> list[float]:
        self.calls += len(samples)
        await self.release.wait()
        return [1.0] * len(samples)


slow_reward = SlowReward()


class LongTail:
    """Group 1's samples answer only once ``release`` is set; the others at once."""

    release = asyncio.Event()

    async def __call__(self, sample: Sample, ctx: object) -> Sample:
        if sample.group_index == 1:
            await self.release.wait()
        return await instant(sample, ctx)


long_tail = LongTail()


class Workload:
    @hookimpl
    def miles_register_generators(self, register):
        register("instant", GeneratorSpec(instant))
        register("long_tail", GeneratorSpec(long_tail))

    @hookimpl
    def miles_register_rewards(self, register):
        register("slow", RewardSpec(slow_reward))

    @hookimpl
    def miles_register_filters(self, register):
        register("breaks_on_group_2", FilterSpec(breaks_on_group_2))


def _workers(filters: list[str], *, capacity: int = 4, reward: str = "exact_match", steps: int = 100,
             version: Callable[[], int] = lambda: 0, **rollout: Any) -> tuple[RolloutWorkers, GroupBuffer]:
    kernel = Kernel.load(PluginSelection(enable=("core", "data", "filters", "generators", "rewards")))
    if "workload" not in {i.name for i in kernel.plugins()}:
        kernel.register_plugin(Workload(), "workload")
    config = MilesConfig(run=RunSection(mode="fully_async", steps=steps), algorithm=AlgorithmSection(correction="tis"),
                         reward=RewardSection(name=reward),
                         rollout=RolloutSection(**{"generator": "instant", "samples_per_prompt": 2, "prompts_per_step": 2,
                                                   "concurrency": 4, "filters": filters, **rollout}))
    manager = RolloutManager(context_for(config, kernel=kernel), open_data_source(context_for(config, kernel=kernel)), engine=None, tokenizer=None)
    buffer = GroupBuffer(capacity, admit=filter_pipeline(filters, kernel), max_staleness=config.rollout.max_staleness,
                         late=config.rollout.late_groups)
    return RolloutWorkers(manager, buffer, version=version), buffer


async def _settle(rounds: int = 200) -> None:
    """Let every ready task run (no timing: the workers here never wait on anything outside the loop)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


def test_groups_being_scored_count_against_the_buffer_without_a_staleness_bound() -> None:
    """Before, with no staleness bound, groups waiting on a slow reward counted nowhere: a buffer
    of 2 let the workers draw about 50 groups. Now at most the buffer's capacity of groups is
    finished (scored or being scored), plus what the generation slots hold."""
    async def scenario() -> None:
        workers, buffer = _workers(["no_aborted"], capacity=2, reward="slow")
        workers.start()
        try:
            while slow_reward.calls < 4:  # two groups are being scored
                await asyncio.sleep(0)
            await _settle()
            assert workers.launched <= 2 + 4 // 2  # capacity + concurrency / samples_per_prompt
            slow_reward.release.set()
            assert len(await buffer.take(2, version=0)) == 2
        finally:
            slow_reward.release.set()
            await workers.stop()

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))


def test_at_max_staleness_0_no_group_starts_while_the_trainer_trains_and_none_is_late() -> None:
    """Before, the launch gate let one batch more start than the bound allows: at max_staleness 0
    every group generated while the trainer trained was stale after the push, and thrown away."""
    version = 0

    async def scenario() -> None:
        workers, buffer = _workers(["no_aborted"], capacity=8, max_staleness=0, version=lambda: version)
        nonlocal version
        workers.start()
        try:
            first = await buffer.take(2, version=0)
            await _settle()  # the trainer trains batch 1
            assert workers.launched == 2  # the next batch would be trained after the push: not yet
            version = 1
            await buffer.weights_updated()
            second = await buffer.take(2, version=1)
            assert [g.staleness(1) for g in second] == [0, 0]
            counts = buffer.take_counts()
            assert not counts["late_trained"] and not counts["late_recycled"]
            assert [g.index for g in first + second] == [0, 1, 2, 3]
        finally:
            await workers.stop()

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))


@pytest.mark.parametrize("late", ["train", "recycle"])
def test_admission_keeps_staleness_within_the_bound_and_trains_a_late_group_instead_of_discarding_it(late: str) -> None:
    """max_staleness 1, a trainer that pushes after every batch, and group 1 a long tail held
    until step 2 is taken. Every other group is trained within the bound; group 1, back at
    staleness 2, is trained with its correction (train) or generated again and trained within
    the bound (recycle): counted either way, and no group is trained twice or dropped."""
    version = 0
    long_tail.release = asyncio.Event()

    async def scenario() -> None:
        nonlocal version
        workers, buffer = _workers(["no_aborted"], capacity=8, max_staleness=1, late_groups=late,
                                   generator="long_tail", concurrency=16, version=lambda: version)
        workers.start()
        trained: list[tuple[int, int]] = []  # (group, staleness when taken)
        counts: Counter[str] = Counter()
        try:
            for step in range(1, 6):
                batch = await buffer.take(2, version=version)
                trained += [(g.index, g.staleness(version)) for g in batch]
                counts.update(buffer.take_counts())
                await _settle()  # the trainer trains
                if step == 2:
                    long_tail.release.set()
                    await _settle()
                version += 1
                await buffer.weights_updated()
        finally:
            long_tail.release.set()
            await workers.stop()
        groups = [g for g, _ in trained]
        assert len(groups) == len(set(groups)) == 10 and 1 in groups
        assert not any(k.endswith("_dropped") for k in counts)
        late_ones = [g for g, staleness in trained if staleness > 1]
        if late == "train":
            assert late_ones == [1] and counts["late_trained"] == 1 and not counts["late_recycled"]
        else:
            assert late_ones == [] and counts["late_recycled"] == 1 and not counts["late_trained"]

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))


def test_launch_pacing_fills_exactly_the_batches_within_the_bound() -> None:
    """AReaL's admission rule counted in this run's batches, resumed runs and intervals included."""
    pacing = LaunchPacing(batch=2, interval=1, max_staleness=1, start_step=0, start_version=0, steps=10)
    assert [pacing.limit(v) for v in range(3)] == [4, 6, 8]  # at version v, batches up to v + 1
    assert pacing.limit(20) == 20  # never more than the steps left
    # pushes after steps 2, 4, ...: batches 0 and 1 at version 0, 2 and 3 at version 1
    assert LaunchPacing(2, 2, 0, 0, 0, 10).limit(0) == 4
    # resumed after step 3 at version 1 (interval 2): step 4 is taken at version 1, steps 5-6 at 2
    resumed = LaunchPacing(2, 2, 0, start_step=3, start_version=1, steps=10)
    assert [resumed.limit(1), resumed.limit(2)] == [2, 6]
    assert LaunchPacing(2, 1, None, 0, 0, 3).limit(0) == 6


def test_workers_keep_the_buffer_filled_with_scored_groups() -> None:
    async def scenario() -> None:
        workers, buffer = _workers(["no_aborted"])
        workers.start()
        try:
            batches = [await buffer.take(2, version=0) for _ in range(3)]
        finally:
            await workers.stop()
        assert [[g.index for g in batch] for batch in batches] == [[0, 1], [2, 3], [4, 5]]
        assert all(s.reward is not None and s.trainable for batch in batches for g in batch for s in g.samples)
        assert workers.take_metrics()["reward/scored"] >= 12

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))


def test_a_worker_error_stops_the_trainer_and_the_finished_groups_are_kept() -> None:
    async def scenario() -> None:
        workers, buffer = _workers(["breaks_on_group_2"])
        workers.start()
        with pytest.raises(PluginError, match="the filter has a bug"):
            await buffer.take(4, version=0)  # groups 0 and 1 came in, then group 2's filter raised
        kept = {g.index for g in await workers.stop()}
        assert {0, 1} <= kept and 2 not in kept

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))


async def refused(sample: Sample, ctx: object) -> Sample:
    sample.tokens = [1, 2]
    return sample.finish(Status.ABORTED, ExitReason.ENGINE_ERROR, "engine answered HTTP 401")


class Refused:
    @hookimpl
    def miles_register_generators(self, register):
        register("refused", GeneratorSpec(refused))


def _refusing_kernel() -> Kernel:
    kernel = Kernel.load(PluginSelection(enable=("core", "data", "filters", "generators", "rewards")))
    if "refused" not in {i.name for i in kernel.plugins()}:
        kernel.register_plugin(Refused(), "refused")
    return kernel


def test_a_run_whose_every_group_aborts_stops_with_the_reason() -> None:
    """Engines that refuse every request must not leave the trainer waiting forever."""
    from types import SimpleNamespace

    from miles.errors import MilesError
    from miles.loop.modes.fully_async import _take

    kernel = _refusing_kernel()
    config = MilesConfig(run=RunSection(mode="fully_async"), algorithm=AlgorithmSection(correction="tis"),
                         rollout=RolloutSection(generator="refused", samples_per_prompt=2, prompts_per_step=2,
                                                concurrency=4))
    manager = RolloutManager(context_for(config, kernel=kernel), open_data_source(context_for(config, kernel=kernel)), engine=None, tokenizer=None)
    buffer = GroupBuffer(4)
    workers = RolloutWorkers(manager, buffer, version=lambda: 0)
    messages: list[str] = []
    run = SimpleNamespace(config=config, state=SimpleNamespace(step=1, version=0),
                          progress=SimpleNamespace(message=messages.append))

    async def scenario() -> None:
        workers.start()
        try:
            with pytest.raises(MilesError, match="every group that finished was aborted.*HTTP 401"):
                await _take(run, buffer, workers, report_every=0.2)
        finally:
            await workers.stop()

    asyncio.run(scenario())
    assert len(messages) == 2  # it said what it was waiting on before giving up


def test_while_aborted_groups_back_off_the_producer_draws_no_new_prompts() -> None:
    """An engine that keeps failing: after each group's second abort it waits out its backoff, and
    the workers wait with it instead of feeding new prompts to the same outage."""
    kernel = _refusing_kernel()
    config = MilesConfig(run=RunSection(mode="fully_async"), algorithm=AlgorithmSection(correction="tis"),
                         rollout=RolloutSection(generator="refused", samples_per_prompt=2, prompts_per_step=2,
                                                concurrency=4))
    manager = RolloutManager(context_for(config, kernel=kernel), open_data_source(context_for(config, kernel=kernel)), engine=None, tokenizer=None)
    buffer = GroupBuffer(4, infra_backoff=lambda aborts: 0.0 if aborts <= 1 else 3600.0)
    workers = RolloutWorkers(manager, buffer, version=lambda: 0)

    async def scenario() -> None:
        workers.start()
        try:
            await _settle(2000)
            # every group drawn was generated twice and now backs off; nothing more is drawn
            launched, waiting = workers.launched, buffer.recycled_groups()
            assert 2 <= len(waiting) <= 4 and launched == 2 * len(waiting)  # at most the 4 slots' worth
            assert all(g.infra_aborts == 2 for g in waiting) and workers.in_flight == 0
            await _settle(2000)
            assert workers.launched == launched
        finally:
            await workers.stop()

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))


def test_aborts_after_a_queued_group_still_stop_the_run_and_one_success_resets_the_count() -> None:
    """The check reads each report's window, not everything since the last batch: one group queued
    early (too few for a batch) must not hide the aborts after it, and a window in which a group
    finishes starts the count again."""
    from collections import Counter
    from types import SimpleNamespace

    from miles.errors import MilesError
    from miles.loop.modes.fully_async import _take

    class Buffer:  # the part of GroupBuffer _take reads; each take() waits one window, then `events` happen
        def __init__(self, windows: list[dict[str, int]]) -> None:
            self.windows, self.counts, self.last_abort = windows, Counter(), "engine answered HTTP 401"

        def __len__(self) -> int:
            return self.counts["queued"]

        async def take(self, wanted: int, version: int) -> list:
            events = self.windows.pop(0) if self.windows else {"aborted_recycled": 1}
            self.counts.update(events)
            await asyncio.sleep(3600)

    def taken(windows: list[dict[str, int]]) -> tuple[int, str]:
        messages: list[str] = []
        run = SimpleNamespace(config=SimpleNamespace(rollout=SimpleNamespace(prompts_per_step=2)),
                              state=SimpleNamespace(step=1, version=0), progress=SimpleNamespace(message=messages.append))
        with pytest.raises(MilesError, match="every group that finished was aborted") as error:
            asyncio.run(_take(run, Buffer(windows), SimpleNamespace(in_flight=4), report_every=0.05))
        return len(messages), str(error.value)

    reports, _ = taken([{"queued": 1}])  # queued, then aborts only
    assert reports == 3  # the queued window, then two aborted ones
    reports, _ = taken([{"aborted_recycled": 2}, {"queued": 1}, {"aborted_dropped": 1}])
    assert reports == 4  # aborted, a success (count reset), then two aborted windows


def test_a_step_stops_drawing_prompts_after_a_round_in_which_every_sample_aborted() -> None:
    """Synchronous collection: engines that abort everything (gone, or restarting) end the step's
    over-sampling after one round, so it does not burn prompts nor teach the over-sampler that
    nothing is ever kept; the runner collects the step again once the engines are back."""
    kernel = _refusing_kernel()
    config = MilesConfig(rollout=RolloutSection(generator="refused", samples_per_prompt=2, prompts_per_step=3,
                                                filters=["no_aborted"]))
    manager = RolloutManager(context_for(config, kernel=kernel), open_data_source(context_for(config, kernel=kernel)), engine=None, tokenizer=None)
    before = manager.over_sampler.state_dict()
    rollout = asyncio.run(manager.collect(1))
    assert len(rollout.all_samples) == 6 and rollout.groups == []  # one round of 3 groups, no more
    assert rollout.metrics["filter/drop_all_aborted"] == 3.0
    assert manager.over_sampler.state_dict() == before


def test_the_last_steps_evaluation_supersedes_one_still_running_and_a_failed_one_still_fails_the_run() -> None:
    """Background evaluations in fully_async: at the last step an earlier one still running would
    report the same keys as the final one and be overwritten: it is dropped and counted instead,
    and the last step waits for the final weights' evaluation. One that failed still fails the run."""
    from types import SimpleNamespace

    from miles.loop.modes.fully_async import BackgroundEvaluation

    async def evaluate(step: int) -> dict[str, float]:
        await asyncio.sleep(0.3 if step < 3 else 0.01)
        if step == 1:
            raise RuntimeError("the eval data is broken")
        return {"eval/accuracy": float(step)}

    def due(step: int) -> bool:  # eval.every=2 over 3 steps, as StepOps.evaluation_due says
        return step % 2 == 0 or step == 3

    run = SimpleNamespace(evaluation_due=due, evaluate=evaluate)

    async def last_step() -> dict:
        evaluation = BackgroundEvaluation(run)
        evaluation.start(2)  # still running when the last step comes
        await evaluation.supersede()
        assert evaluation.due(3)
        evaluation.start(3)
        return await evaluation.finish()

    assert asyncio.run(last_step()) == {"eval/accuracy": 3.0, "eval/step": 3.0, "eval/skipped": 1.0}

    async def failed_before() -> None:
        evaluation = BackgroundEvaluation(run)
        evaluation.start(1)
        await asyncio.sleep(0.5)
        await evaluation.supersede()

    with pytest.raises(RuntimeError, match="the eval data is broken"):
        asyncio.run(failed_before())


def test_evaluation_numbers_its_samples_apart_from_training() -> None:
    """An evaluation between two steps must not shift the indices (the run.deterministic sampling
    seeds, the long-tail workload's episodes) of the training samples after it; the counters
    survive a checkpoint."""
    kernel = _refusing_kernel()
    config = MilesConfig(rollout=RolloutSection(generator="refused", samples_per_prompt=2, prompts_per_step=1))
    manager = RolloutManager(context_for(config, kernel=kernel), open_data_source(context_for(config, kernel=kernel)), engine=None, tokenizer=None)
    first = manager.make_groups(manager.data.next_prompts(1), 2)
    evaluated = manager.make_groups(manager.data.next_prompts(2), 3, evaluation=True)
    second = manager.make_groups(manager.data.next_prompts(1), 2)
    assert [(s.group_index, s.index) for g in first + second for s in g] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    assert [(s.group_index, s.index) for g in evaluated for s in g] == [(0, 0), (0, 1), (0, 2), (1, 3), (1, 4), (1, 5)]
    state = manager.state_dict()
    again = RolloutManager(context_for(config, kernel=kernel), open_data_source(context_for(config, kernel=kernel)), engine=None, tokenizer=None)
    again.load_state_dict(state)
    assert [s.index for g in again.make_groups(again.data.next_prompts(1), 2, evaluation=True) for s in g] == [6, 7]
    assert [s.index for g in again.make_groups(again.data.next_prompts(1), 2) for s in g] == [4, 5]


async def always_raises(sample: Sample, ctx: object) -> Sample:
    raise ConnectionError("agent sandbox unreachable")


class Broken:
    @hookimpl
    def miles_register_generators(self, register):
        register("always_raises", GeneratorSpec(always_raises))


def _broken_manager(mode: str) -> RolloutManager:
    kernel = Kernel.load(PluginSelection(enable=("core", "data", "filters", "generators", "rewards")))
    if "broken" not in {i.name for i in kernel.plugins()}:
        kernel.register_plugin(Broken(), "broken")
    config = MilesConfig(run=RunSection(mode=mode), algorithm=AlgorithmSection(correction="tis"),
                         rollout=RolloutSection(generator="always_raises", samples_per_prompt=2, prompts_per_step=2,
                                                concurrency=4, max_generator_failures=5))
    ctx = context_for(config, kernel=kernel)
    return RolloutManager(ctx, open_data_source(ctx), engine=None, tokenizer=None)


def test_a_generator_that_only_raises_stops_a_fully_async_run_with_its_error() -> None:
    """Before, the trainer waited forever while the workers burnt prompts, every group dropped
    as failed. After rollout.max_generator_failures calls in a row that raise, the run stops with
    an error naming the generator and its last exception."""
    from miles.errors import MilesError

    manager = _broken_manager("fully_async")
    buffer = GroupBuffer(4, admit=filter_pipeline(["no_aborted"], manager.kernel))
    workers = RolloutWorkers(manager, buffer, version=lambda: 0)

    async def scenario() -> None:
        workers.start()
        try:
            with pytest.raises(MilesError) as error:
                await asyncio.wait_for(buffer.take(2, version=0), timeout=30)  # a deadline, not a timing
        finally:
            await workers.stop()
        message = str(error.value)
        assert "'always_raises'" in message and "5 calls in a row" in message
        assert "ConnectionError: agent sandbox unreachable" in message and "rollout.max_generator_failures" in message

    asyncio.run(scenario())
    assert workers.launched < 10  # it stopped drawing prompts soon after the source was known to fail


def test_a_generator_that_only_raises_stops_a_sync_step_and_one_success_resets_the_count() -> None:
    from miles.errors import MilesError

    manager = _broken_manager("sync")
    with pytest.raises(MilesError, match="generator 'always_raises' raised on 5 calls in a row"):
        asyncio.run(asyncio.wait_for(manager.collect(1), timeout=30))

    calls = 0

    async def every_fourth_works(sample: Sample, ctx: object) -> Sample:
        nonlocal calls
        calls += 1
        if calls % 4:
            raise ConnectionError("flaky")
        return await instant(sample, ctx)

    manager = _broken_manager("sync")
    manager.generator = every_fourth_works
    rollout = asyncio.run(asyncio.wait_for(manager.collect(1), timeout=30))  # 3 in a row at most: never stops
    assert rollout.metrics["rollout/status_failed"] > 0
