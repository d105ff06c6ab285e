"""miles.rewards.score_samples: grouping by reward name, concurrency, timeouts and per-sample failures."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest
from miles import hookimpl
from miles.config import MilesConfig
from miles.context import context_for
from miles.kernel import Kernel
from miles.plugins import PluginSelection, load_plugins
from miles.registry import Register, UnknownNameError
from miles.rewards import score_samples, score_samples_blocking
from miles.sections import RewardSection
from miles_contracts import Branch, ExitReason, RewardSpec, Sample, Status

RELEASE = threading.Event()


def picky(samples: Sequence[Sample]) -> list[float]:
    if any(s.response == "boom" for s in samples):
        raise ValueError("cannot score 'boom'")
    return [1.0] * len(samples)


async def slow(samples: Sequence[Sample]) -> list[float]:
    if any(s.response == "hang" for s in samples):
        await asyncio.sleep(30)
    return [0.5] * len(samples)


def waits_for_the_loop(samples: Sequence[Sample]) -> list[float]:
    """Blocks until a task on the event loop runs: only possible if this runs off the loop."""
    return [1.0 if RELEASE.wait(timeout=10) else 0.0] * len(samples)


class RewardsForTests:
    @hookimpl
    def miles_register_rewards(self, register: Register) -> None:
        register("picky", RewardSpec(picky))
        register("slow", RewardSpec(slow))
        register("waits_for_the_loop", RewardSpec(waits_for_the_loop))
        register("nothing", RewardSpec(lambda samples: []))
        register("nan_for_empty", RewardSpec(lambda samples: [float("nan") if not s.response else 1.0 for s in samples]))
        register("per_role", RewardSpec(per_role))


def per_role(samples: Sequence[Sample]) -> list[float | dict[str, object]]:
    """A game of two agents: the response names the winner; some responses make broken mappings."""
    answers: dict[str, float | dict[str, object]] = {
        "solver wins": {"solver": 1.0, "critic": 0.0},
        "critic wins": {"solver": 0.0, "critic": 1.0},
        "no solver": {"critic": 1.0},
        "nan critic": {"solver": 1.0, "critic": float("nan")},
        "text critic": {"solver": 1.0, "critic": "high"},
        "plain": 0.5,
    }
    return [answers[s.response] for s in samples]


@pytest.fixture(scope="module")
def kernel() -> Kernel:
    selection = PluginSelection(enable=("rewards",))
    kernel = Kernel(load_plugins(selection), selection)
    kernel.register_plugin(RewardsForTests(), "rewards_for_tests")
    return kernel


def completed(response: str, label: str | None = "4", reward: str | None = None, index: int = 0) -> Sample:
    metadata = {"reward": reward} if reward else {}
    return Sample(prompt="2+2?", response=response, label=label, status=Status.COMPLETED, metadata=metadata, index=index)


def test_scores_every_sample_with_its_reward(kernel: Kernel) -> None:
    samples = [completed("4", index=0), completed("5", index=1), completed("anything", reward="picky", index=2)]
    report = score_samples_blocking(samples, context_for(MilesConfig(reward=RewardSection(name="exact_match")), kernel=kernel))
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0]
    assert all(s.status is Status.COMPLETED for s in samples)
    assert (report.scored, report.failed, report.skipped) == (3, 0, 0)
    assert set(report.seconds) == {"exact_match", "picky"}
    assert report.metrics()["reward/scored"] == 3.0


def test_a_raising_reward_fails_only_the_sample_it_cannot_score(kernel: Kernel) -> None:
    samples = [completed("fine", index=0), completed("boom", index=1), completed("also fine", index=2)]
    report = score_samples_blocking(samples, context_for(MilesConfig(reward=RewardSection(name="picky")), kernel=kernel))
    assert [s.reward for s in samples] == [1.0, None, 1.0]
    bad = samples[1]
    assert bad.status is Status.FAILED and bad.exit_reason is ExitReason.REWARD_ERROR
    assert "ValueError" in bad.exit_detail and "cannot score 'boom'" in bad.exit_detail
    assert report.failed == 1 and report.errors == [f"sample 1: {bad.exit_detail}"]


def test_a_reward_that_times_out_fails_its_samples_not_the_others(kernel: Kernel) -> None:
    samples = [completed("hang", reward="slow", index=0), completed("4", index=1)]
    report = score_samples_blocking(samples, context_for(MilesConfig(reward=RewardSection(name="exact_match", timeout=0.2)), kernel=kernel))
    assert samples[0].status is Status.FAILED
    assert "did not finish within 0.2 s (reward.timeout)" in samples[0].exit_detail
    assert samples[1].reward == 1.0 and samples[1].status is Status.COMPLETED
    assert report.failed == 1 and report.scored == 1


def test_nan_and_wrong_shapes_mark_samples(kernel: Kernel) -> None:
    samples = [completed("", reward="nan_for_empty", index=0), completed("x", reward="nan_for_empty", index=1),
               completed("x", reward="nothing", index=2)]
    score_samples_blocking(samples, context_for(MilesConfig(reward=RewardSection()), kernel=kernel))
    assert "returned nan" in samples[0].exit_detail and samples[0].status is Status.FAILED
    assert samples[1].reward == 1.0
    assert "returned 0 values for 1 samples" in samples[2].exit_detail


def test_samples_without_a_response_are_skipped(kernel: Kernel) -> None:
    aborted = completed("", index=0).finish(Status.ABORTED, ExitReason.ABORT)
    report = score_samples_blocking([aborted, completed("4", index=1)], context_for(MilesConfig(reward=RewardSection()), kernel=kernel))
    assert aborted.reward is None and aborted.status is Status.ABORTED and aborted.exit_reason is ExitReason.ABORT
    assert (report.scored, report.skipped) == (1, 1)


def test_unknown_reward_names_are_errors_naming_the_sample(kernel: Kernel) -> None:
    with pytest.raises(UnknownNameError, match=r'metadata\["reward"\] of sample 7: unknown reward \'exact_mach\'.*exact_match'):
        score_samples_blocking([completed("4", reward="exact_mach", index=7)], context_for(MilesConfig(reward=RewardSection()), kernel=kernel))
    bad = completed("4", index=8)
    bad.metadata["reward"] = {"name": "f1"}
    with pytest.raises(TypeError, match=r'metadata\["reward"\] of sample 8 is \{\'name\': \'f1\'\}; expected the name'):
        score_samples_blocking([bad], context_for(MilesConfig(reward=RewardSection()), kernel=kernel))


def test_sync_rewards_run_off_the_event_loop(kernel: Kernel) -> None:
    RELEASE.clear()
    samples = [completed("x", reward="waits_for_the_loop")]

    async def main() -> None:
        async def release() -> None:
            await asyncio.sleep(0)
            RELEASE.set()

        await asyncio.gather(score_samples(samples, context_for(MilesConfig(reward=RewardSection()), kernel=kernel)), release())

    asyncio.run(main())
    assert samples[0].reward == 1.0  # 0.0 would mean the reward blocked the loop until its wait gave up


def episode(response: str, role: str | None, index: int) -> Sample:
    """An episode's primary branch (``role`` None: a sample without a branch)."""
    sample = completed(response, reward="per_role", index=index)
    if role is not None:
        sample.branch = Branch(episode_id=f"e{index}", branch_id=0, role=role)
        sample.branches = [Sample(branch=Branch(episode_id=f"e{index}", branch_id=1, parent_branch=0, role="critic",
                                                cause="subagent"), status=Status.COMPLETED)]
    return sample


def test_a_reward_of_several_agents_scores_each_role(kernel: Kernel) -> None:
    """{role: reward}: the sample's reward is its own role's, and its branches of other roles get theirs."""
    samples = [episode("solver wins", "solver", 0), episode("critic wins", "solver", 1), episode("plain", "solver", 2)]
    report = score_samples_blocking(samples, context_for(MilesConfig(reward=RewardSection(name="per_role")), kernel=kernel))
    assert report.scored == 3 and report.failed == 0
    assert [s.reward for s in samples] == [1.0, 0.0, 0.5]
    assert samples[0].role_rewards == {"solver": 1.0, "critic": 0.0} and samples[2].role_rewards == {}
    assert [[row.reward for row in s.rows()] for s in samples] == [[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]


@pytest.mark.parametrize(("response", "role", "problem"), [
    ("no solver", "solver", "without the sample's own role 'solver'"),
    ("nan critic", "solver", "the value of 'critic' is not a finite number"),
    ("text critic", "solver", "the value of 'critic' is not a finite number"),
    ("solver wins", None, "for a sample without a role (sample.branch is None)"),
])
def test_a_broken_per_role_reward_fails_only_its_sample(kernel: Kernel, response: str, role: str | None,
                                                         problem: str) -> None:
    bad, good = episode(response, role, 0), episode("solver wins", "solver", 1)
    report = score_samples_blocking([bad, good], context_for(MilesConfig(reward=RewardSection(name="per_role")), kernel=kernel))
    assert bad.status is Status.FAILED and bad.exit_reason is ExitReason.REWARD_ERROR and bad.reward is None
    assert problem in bad.exit_detail and "reward 'per_role'" in bad.exit_detail
    assert bad.role_rewards == {} and not any(row.trainable for row in bad.rows())
    assert good.reward == 1.0 and (report.scored, report.failed) == (1, 1)
