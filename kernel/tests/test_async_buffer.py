"""The fully_async buffer's contract (docs/design/async.md), point by point."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from miles.loop.buffer import (
    MAX_ATTEMPTS,
    MAX_INFRA_ATTEMPTS,
    BufferClosedError,
    Group,
    GroupBuffer,
    infra_retry_delay,
)
from miles.loop.modes.fully_async import batch_metrics
from miles_contracts import Branch, ExitReason, Sample, Status


def group(index: int, versions: Sequence[int] = (0,), status: Status = Status.COMPLETED, size: int = 2,
          reasons: Sequence[ExitReason | None] = ()) -> Group:
    """A finished group whose samples ran with weight ``versions`` (one engine call each)."""
    samples = [Sample(prompt=f"p{index}", group_index=index, index=index * size + j) for j in range(size)]
    return ended(Group.fresh(samples), status, reasons, versions)


def ended(g: Group, status: Status, reasons: Sequence[ExitReason | None] = (), versions: Sequence[int] = (0,)) -> Group:
    """``g`` generated: each sample ends ``status`` for its entry of ``reasons`` (default: an
    engine abort when aborted, else a stop)."""
    default = ExitReason.ABORT if status is Status.ABORTED else ExitReason.STOP
    for j, s in enumerate(g.samples):
        s.tokens, s.response_length, s.loss_mask = [1, 2], 1, [1]
        s.weight_versions, s.reward = list(versions), 1.0
        s.finish(status, reasons[j] if j < len(reasons) else default)
    return g


class Recorder:
    """The part of the ledger the buffer calls: what it recorded, as (group, state, reason)."""

    def __init__(self) -> None:
        self.lines: list[tuple[int, str, str | None]] = []

    def record(self, samples: Sequence[Sample], state: str, *, reason: str | None = None,
               step: int | None = None) -> None:
        self.lines.append((samples[0].group_index, state, reason))


def NO_BACKOFF(infra_aborts: int) -> float:  # noqa: N802 - a constant-like stand-in for infra_retry_delay
    """Counting tests: every recycled group may go again at once."""
    return 0.0


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=10))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_equally_old_groups_leave_first_in_first_out_and_each_batch_is_sorted_by_group_index() -> None:
    async def scenario() -> list[list[int]]:
        buffer = GroupBuffer(capacity=8)
        for index in (3, 1, 2, 0, 5, 4):  # completion order
            await buffer.put(group(index))
        return [[g.index for g in await buffer.take(3, version=0)] for _ in range(2)]

    assert run(scenario()) == [[1, 2, 3], [0, 4, 5]]


def test_a_producer_blocks_while_the_buffer_is_full() -> None:
    async def scenario() -> None:
        buffer = GroupBuffer(capacity=1)
        assert await buffer.put(group(0)) == "queued"
        blocked_put = asyncio.create_task(buffer.put(group(1)))
        blocked_room = asyncio.create_task(buffer.wait_for_launch())
        await settle()
        assert not blocked_put.done() and not blocked_room.done() and len(buffer) == 1
        assert [g.index for g in await buffer.take(1, version=0)] == [0]
        assert await blocked_put == "queued"  # the taken group made room for the waiting one
        await settle()
        assert not blocked_room.done()  # ... and the buffer is full again
        await buffer.take(1, version=0)
        await blocked_room

    run(scenario())


def test_the_oldest_finished_groups_are_trained_first() -> None:
    """A group that came back late (a long tail) is not queued behind younger ones: it is taken
    first, within the bound, instead of waiting until it is past it."""
    async def scenario() -> list[int]:
        buffer = GroupBuffer(capacity=8, max_staleness=1)
        for index, version in ((0, 2), (1, 2), (2, 1), (3, 2)):  # completion order; group 2 is a long tail
            await buffer.put(group(index, versions=(version,)))
        taken = [g.index for g in await buffer.take(2, version=2)]
        assert not buffer.take_counts()["late_trained"]
        return taken

    assert run(scenario()) == [0, 2]


def test_groups_being_scored_count_as_finished_groups() -> None:
    """With a slow reward, groups that finished generating wait in scoring: counted nowhere, the
    producer went on drawing (a buffer of 2 held about 50 such groups)."""
    async def scenario() -> None:
        buffer = GroupBuffer(capacity=2)
        scoring = 1
        await buffer.put(group(0))
        gated = asyncio.create_task(buffer.wait_for_launch(lambda: scoring))  # 1 queued + 1 being scored
        await settle()
        assert not gated.done()
        scoring = 0
        await buffer.take(1, version=0)
        await gated

    run(scenario())


def test_with_a_limit_a_producer_waits_while_that_many_groups_are_reserved() -> None:
    """Reserved groups (launched, headed for training) hold their place until trained; a filtered
    or aborted one gives it back, so its replacement may start."""
    def admit(samples: Sequence[Sample]) -> str | None:
        return "zero_std" if samples[0].group_index == 1 else None

    async def scenario() -> None:
        buffer = GroupBuffer(capacity=8, admit=admit)
        limit = 2
        for _ in range(2):
            buffer.reserve()
        gated = asyncio.create_task(buffer.wait_for_launch(limit=lambda: limit))
        await buffer.put(group(0))
        await buffer.take(1, version=0)  # trained: still counts against the limit
        await settle()
        assert not gated.done()
        assert await buffer.put(group(1)) == "filtered_zero_std"  # its place is free again
        await gated
        buffer.reserve()
        gated = asyncio.create_task(buffer.wait_for_launch(limit=lambda: limit))
        await settle()
        assert not gated.done()
        limit = 3  # a new weight version lets more start
        await buffer.weights_updated()
        await gated

    run(scenario())


def test_nothing_is_stale_before_the_first_update() -> None:
    async def scenario() -> None:
        buffer = GroupBuffer(capacity=8, max_staleness=0, start_version=3)
        await buffer.put(group(0, versions=(0,)))  # older than the start version: a resumed run's leftovers
        await buffer.put(group(1, versions=()))  # no engine call reported a version
        assert [g.index for g in await buffer.take(2, version=3)] == [0, 1]
        assert not buffer.take_counts()["late_trained"]

    run(scenario())


@pytest.mark.parametrize("policy", ["train", "recycle"])
def test_late_groups_are_trained_or_recycled_never_thrown_away_and_counted(policy: str) -> None:
    async def scenario() -> None:
        buffer = GroupBuffer(capacity=8, max_staleness=1, late=policy)
        for _ in range(3):
            buffer.reserve()
        old, spanning, fresh = group(0, versions=(0,)), group(1, versions=(0, 2)), group(2, versions=(1, 2))
        for g in (old, spanning, fresh):
            await buffer.put(g)
        # at version 2: staleness is 2 for the first two (their oldest call ran version 0), 1 for the last
        if policy == "train":
            assert [g.index for g in await buffer.take(3, version=2)] == [0, 1, 2]
            assert buffer.take_counts()["late_trained"] == 2 and buffer.next_recycled() is None
            assert buffer.reserved == 3
            return
        assert [g.index for g in await buffer.take(1, version=2)] == [2]
        assert buffer.take_counts()["late_recycled"] == 2 and buffer.reserved == 1  # their places are free
        again = [buffer.next_recycled(), buffer.next_recycled()]
        assert [g.index for g in again] == [0, 1] and buffer.next_recycled() is None
        for g in again:  # regenerated from the prompt, as drawn
            assert g.attempt == 2 and all(s.tokens == [] and s.status is Status.PENDING for s in g.samples)
            assert [s.prompt for s in g.samples] == [f"p{g.index}"] * 2

    run(scenario())


def test_a_branch_older_than_its_episodes_primary_makes_the_group_stale() -> None:
    """An episode's rows are trained together: a branch whose turns ran older weights than every
    turn of the episode's primary branch (an abandoned attempt, a compacted history) ages the group."""
    async def scenario() -> None:
        buffer = GroupBuffer(capacity=8, max_staleness=1, late="recycle")
        aged = group(0, versions=(2,))
        aged.samples[1].branches = [Sample(weight_versions=[0], branch=Branch(episode_id="e", branch_id=1))]
        await buffer.put(aged)
        await buffer.put(group(1, versions=(2,)))
        assert [g.index for g in await buffer.take(1, version=2)] == [1]
        assert buffer.take_counts()["late_recycled"] == 1

    run(scenario())


def test_a_late_group_that_used_up_its_attempts_is_trained_as_it_is() -> None:
    async def scenario() -> None:
        buffer = GroupBuffer(capacity=4, max_staleness=0, late="recycle", max_attempts=2)
        await buffer.put(group(0))
        await buffer.put(group(1, versions=(1,)))
        await buffer.take(1, version=1)
        second = buffer.next_recycled()
        assert second is not None and second.attempt == 2
        for s in second.samples:
            s.weight_versions, s.status = [1], Status.COMPLETED
        await buffer.put(second)
        await buffer.put(group(2, versions=(2,)))
        assert [g.index for g in await buffer.take(2, version=2)] == [0, 2]
        counts = buffer.take_counts()
        assert counts["late_recycled"] == 1 and counts["late_trained"] == 1 and buffer.next_recycled() is None

    run(scenario())


def test_an_aborted_group_recycled_too_often_is_dropped() -> None:
    async def scenario() -> None:
        buffer = GroupBuffer(capacity=4, max_attempts=2)
        budget = [ExitReason.WALL_CLOCK_BUDGET] * 2  # the prompt's own abort (the second has no reason)
        assert await buffer.put(group(0, status=Status.ABORTED, reasons=budget)) == "aborted_recycled"
        second = buffer.next_recycled()
        assert second is not None and second.attempt == 2
        for s in second.samples:
            s.status = Status.ABORTED
        assert await buffer.put(second) == "aborted_dropped"
        counts = buffer.take_counts()
        assert counts["attempts_exhausted"] == 1 and buffer.next_recycled() is None

    run(scenario())


def test_infrastructure_aborts_do_not_use_up_a_prompts_attempts() -> None:
    """Killed engines, a router that gave up, a weight update's pause: such aborts say nothing
    about the prompt. A group they abort more often than ``MAX_ATTEMPTS`` is still generated
    again, and trained once a generation succeeds."""
    async def scenario() -> None:
        buffer = GroupBuffer(capacity=4, infra_backoff=NO_BACKOFF)
        buffer.reserve()
        current = group(0, status=Status.ABORTED, reasons=[ExitReason.ENGINE_ERROR, ExitReason.ABORT])
        for _ in range(MAX_ATTEMPTS + 2):
            assert await buffer.put(current) == "aborted_recycled"
            again = buffer.next_recycled()
            assert again is not None and again.index == 0
            buffer.reserve()
            current = ended(again, Status.ABORTED, [ExitReason.ABORT, ExitReason.ENGINE_ERROR])
        partly = ended(current, Status.COMPLETED)
        partly.samples[1].finish(Status.ABORTED, ExitReason.ENGINE_ERROR)  # the other sample completed: still infra
        assert await buffer.put(partly) == "aborted_recycled"
        last = buffer.next_recycled()
        assert last is not None and (last.attempt, last.infra_aborts, last.prompt_attempts) == (MAX_ATTEMPTS + 4,
                                                                                                 MAX_ATTEMPTS + 3, 1)
        buffer.reserve()
        assert await buffer.put(ended(last, Status.COMPLETED)) == "queued"
        [trained] = await buffer.take(1, version=0)
        assert trained is last and buffer.reserved == 1
        counts = buffer.take_counts()
        assert counts["aborted_recycled"] == MAX_ATTEMPTS + 3 and counts["queued"] == 1
        assert not counts["aborted_dropped"] and not counts["attempts_exhausted"]

    run(scenario())


def test_infrastructure_aborts_have_a_bound_of_their_own_with_its_reason_and_count() -> None:
    """A fleet that never recovers must not keep a group cycling: after ``MAX_INFRA_ATTEMPTS``
    generations lost to the infrastructure it is dropped, under a reason and count of its own,
    and the count reaches the step's metrics."""
    async def scenario() -> None:
        ledger = Recorder()
        buffer = GroupBuffer(capacity=4, ledger=ledger, infra_backoff=NO_BACKOFF)  # type: ignore[arg-type]
        current = group(0, status=Status.ABORTED)
        outcomes = []
        for _ in range(MAX_INFRA_ATTEMPTS):
            outcomes.append(await buffer.put(current))
            again = buffer.next_recycled()
            if again is None:
                break
            current = ended(again, Status.ABORTED, [ExitReason.ENGINE_ERROR] * 2)
        assert outcomes == ["aborted_recycled"] * (MAX_INFRA_ATTEMPTS - 1) + ["aborted_dropped"]
        assert current.attempt == current.infra_aborts + 1 == MAX_INFRA_ATTEMPTS
        assert ledger.lines[-1] == (0, "dropped", "aborted_infra_attempts_exhausted")
        assert buffer.counts["infra_attempts_exhausted"] == 1 and not buffer.counts["attempts_exhausted"]
        await buffer.put(group(1))
        metrics = batch_metrics(await buffer.take(1, version=0), buffer, 0, waited=0.0, interval=1.0)
        assert metrics["async/infra_attempts_exhausted"] == 1.0 and metrics["async/attempts_exhausted"] == 0.0
        assert metrics["async/aborted_dropped"] == 1.0

    run(scenario())


def test_repeated_infrastructure_aborts_back_off_before_the_next_generation() -> None:
    """An outage (an engine restarting for 10-20 s) must not burn a group's infrastructure
    attempts in a burst: the first abort goes again at once, later ones wait, doubling, so the
    bound's generations span longer than a restart."""
    delays = [infra_retry_delay(k) for k in range(1, MAX_INFRA_ATTEMPTS)]
    assert delays[0] == 0.0 and delays[1] > 0.0
    assert all(b >= a for a, b in zip(delays, delays[1:], strict=False)) and sum(delays) > 30.0

    async def scenario() -> None:
        now = [100.0]
        buffer = GroupBuffer(capacity=4, clock=lambda: now[0])
        current = group(0, status=Status.ABORTED, reasons=[ExitReason.ENGINE_ERROR] * 2)
        assert await buffer.put(current) == "aborted_recycled"
        first = buffer.next_recycled()  # a one-off abort: at once
        assert first is not None and first.infra_aborts == 1
        assert await buffer.put(ended(first, Status.ABORTED, [ExitReason.ENGINE_ERROR] * 2)) == "aborted_recycled"
        assert buffer.next_recycled() is None and buffer.recycled == 1  # backing off, still held
        assert 0 in buffer.holding()
        now[0] += infra_retry_delay(2)
        second = buffer.next_recycled()
        assert second is not None and second.infra_aborts == 2
        # a prompt's own abort is generated again at once, and an older group backing off does not hold it up
        assert await buffer.put(ended(second, Status.ABORTED, [ExitReason.ENGINE_ERROR] * 2)) == "aborted_recycled"
        assert await buffer.put(group(1, status=Status.ABORTED, reasons=[ExitReason.AGENT_EXCEPTION] * 2)) == (
            "aborted_recycled")
        ready = buffer.next_recycled()
        assert ready is not None and ready.index == 1 and buffer.next_recycled() is None
        now[0] += infra_retry_delay(3)
        third = buffer.next_recycled()
        assert third is not None and (third.index, third.infra_aborts) == (0, 3)

    run(scenario())


def test_the_producer_waits_out_a_backoff_instead_of_drawing_new_prompts() -> None:
    """``wait_recycled`` returns at once with nothing recycled or a group ready, and otherwise
    only once the earliest backoff is over (the producer then takes that group, not a new prompt)."""
    async def scenario() -> None:
        buffer = GroupBuffer(capacity=4, infra_backoff=lambda k: 0.05)
        await asyncio.wait_for(buffer.wait_recycled(), 1.0)  # nothing recycled
        assert await buffer.put(group(0, status=Status.ABORTED, reasons=[ExitReason.ABORT] * 2)) == "aborted_recycled"
        [waiting] = buffer.recycled_groups()
        assert buffer.next_recycled() is None
        await asyncio.wait_for(buffer.wait_recycled(poll_s=0.01), 5.0)
        assert buffer.clock() >= waiting.not_before
        assert buffer.next_recycled() is waiting
        # a stopped buffer does not keep anyone waiting
        assert await buffer.put(group(1, status=Status.ABORTED, reasons=[ExitReason.ABORT] * 2)) == "aborted_recycled"
        buffer.drain()
        await asyncio.wait_for(buffer.wait_recycled(), 1.0)

    run(scenario())


@pytest.mark.parametrize("reason", [ExitReason.WALL_CLOCK_BUDGET, ExitReason.TOOL_TIMEOUT_BUDGET,
                                    ExitReason.AGENT_EXCEPTION, ExitReason.TIMEOUT, None])
def test_a_prompt_whose_own_episodes_keep_aborting_is_still_dropped_after_max_attempts(
        reason: ExitReason | None) -> None:
    """Only the prompt's aborts count against ``MAX_ATTEMPTS``: infrastructure aborts before them
    do not bring the drop forward."""
    async def scenario() -> None:
        ledger = Recorder()
        buffer = GroupBuffer(capacity=4, ledger=ledger, infra_backoff=NO_BACKOFF)  # type: ignore[arg-type]
        current = group(0, status=Status.ABORTED)  # two engine aborts first
        outcomes = [await buffer.put(current)]
        again = buffer.next_recycled()
        assert again is not None
        outcomes.append(await buffer.put(ended(again, Status.ABORTED, [ExitReason.ENGINE_ERROR] * 2)))
        for _ in range(MAX_ATTEMPTS):
            again = buffer.next_recycled()
            assert again is not None
            current = ended(again, Status.ABORTED, [reason] * 2)
            outcomes.append(await buffer.put(current))
        assert outcomes == ["aborted_recycled"] * (MAX_ATTEMPTS + 1) + ["aborted_dropped"]
        assert (current.attempt, current.prompt_attempts) == (MAX_ATTEMPTS + 2, MAX_ATTEMPTS)
        assert buffer.next_recycled() is None
        assert ledger.lines[-1] == (0, "dropped", "aborted_attempts_exhausted")
        counts = buffer.take_counts()
        assert counts["attempts_exhausted"] == 1 and not counts["infra_attempts_exhausted"]

    run(scenario())


def test_a_group_that_mixes_infrastructure_and_prompt_aborts_is_the_prompts_abort() -> None:
    """One sample the engine aborted, another over its wall-clock budget: the prompt's episode
    failed too, so the generation counts against ``MAX_ATTEMPTS``, and the ledger's ``aborted``
    line names the prompt's reason."""
    mixed = [ExitReason.ABORT, ExitReason.WALL_CLOCK_BUDGET]

    async def scenario() -> None:
        ledger = Recorder()
        buffer = GroupBuffer(capacity=4, ledger=ledger)  # type: ignore[arg-type]
        assert await buffer.put(group(0, status=Status.ABORTED)) == "aborted_recycled"  # an engine abort
        outcomes = []
        for _ in range(MAX_ATTEMPTS):
            again = buffer.next_recycled()
            assert again is not None
            outcomes.append(await buffer.put(ended(again, Status.ABORTED, mixed)))
        assert outcomes == ["aborted_recycled"] * (MAX_ATTEMPTS - 1) + ["aborted_dropped"]
        aborted = [reason for _, state, reason in ledger.lines if state == "aborted"]
        assert aborted == ["abort"] + ["wall_clock_budget"] * MAX_ATTEMPTS
        assert ledger.lines[-1] == (0, "dropped", "aborted_attempts_exhausted")
        assert buffer.take_counts()["attempts_exhausted"] == 1

    run(scenario())


def test_a_late_group_keeps_its_late_recycles_after_infrastructure_aborts() -> None:
    async def scenario() -> None:
        buffer = GroupBuffer(capacity=4, max_staleness=0, late="recycle", max_attempts=2)
        assert await buffer.put(group(0, status=Status.ABORTED)) == "aborted_recycled"
        again = buffer.next_recycled()
        assert again is not None
        await buffer.put(ended(again, Status.COMPLETED, versions=(0,)))
        await buffer.put(group(1, versions=(1,)))
        assert [g.index for g in await buffer.take(1, version=1)] == [1]
        late = buffer.next_recycled()
        assert late is not None and (late.attempt, late.infra_aborts) == (3, 1)
        assert buffer.take_counts()["late_recycled"] == 1

    run(scenario())


def test_filtered_groups_are_counted_by_reason_and_never_recycled() -> None:
    def admit(samples: Sequence[Sample]) -> str | None:
        return "zero_std" if samples[0].group_index % 2 else None

    async def scenario() -> None:
        buffer = GroupBuffer(capacity=8, admit=admit, unused="recycle")
        outcomes = [await buffer.put(group(i)) for i in range(4)]
        assert outcomes == ["queued", "filtered_zero_std", "queued", "filtered_zero_std"]
        assert buffer.take_counts()["filtered_zero_std"] == 2
        assert buffer.next_recycled() is None and len(buffer) == 2

    run(scenario())


@pytest.mark.parametrize("policy", ["recycle", "drop"])
def test_an_aborted_group_is_recycled_or_dropped_by_policy(policy: str) -> None:
    def admit(samples: Sequence[Sample]) -> str | None:
        raise AssertionError("an aborted group never reaches the filters")

    async def scenario() -> None:
        buffer = GroupBuffer(capacity=8, unused=policy, admit=admit)
        outcome = {"recycle": "aborted_recycled", "drop": "aborted_dropped"}[policy]
        assert await buffer.put(group(0, status=Status.ABORTED)) == outcome
        assert len(buffer) == 0 and buffer.take_counts()[outcome] == 1
        recycled = buffer.next_recycled()
        assert (recycled is not None and recycled.index == 0) == (policy == "recycle")

    run(scenario())


def test_a_worker_error_reaches_the_taker_and_no_finished_group_is_lost() -> None:
    async def scenario() -> None:
        buffer = GroupBuffer(capacity=2)
        await buffer.put(group(0))
        await buffer.put(group(1))
        waiting = asyncio.create_task(buffer.put(group(2)))  # finished, blocked by the full buffer
        take = asyncio.create_task(buffer.take(4, version=0))  # takes 0, 1 and 2, then waits for a fourth
        await settle()
        await buffer.fail(RuntimeError("the reward plugin broke"))
        with pytest.raises(RuntimeError, match="the reward plugin broke"):
            await take
        assert await waiting == "queued"
        assert [g.index for g in buffer.drain()] == [0, 1, 2]  # the batch never trained: all kept

    run(scenario())


def test_a_group_waiting_for_room_when_a_worker_fails_is_kept() -> None:
    async def scenario() -> None:
        buffer = GroupBuffer(capacity=1)
        await buffer.put(group(0))
        waiting = asyncio.create_task(buffer.put(group(1)))
        await settle()
        await buffer.fail(ValueError("data source broke"))
        with pytest.raises(ValueError, match="data source broke"):
            await waiting
        assert [g.index for g in buffer.drain()] == [0, 1]
        with pytest.raises(BufferClosedError):  # the run is stopping: nothing more comes in
            await _closed_buffer().put(group(2))

    run(scenario())


def _closed_buffer() -> GroupBuffer:
    buffer = GroupBuffer(capacity=1)
    buffer.drain()
    return buffer


def test_a_take_that_is_cancelled_leaves_its_groups_in_the_buffer_in_order() -> None:
    async def scenario() -> None:
        buffer = GroupBuffer(capacity=4)
        await buffer.put(group(0))
        await buffer.put(group(1))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(buffer.take(3, version=0), timeout=0.05)
        assert [g.index for g in await buffer.take(2, version=0)] == [0, 1]

    run(scenario())
