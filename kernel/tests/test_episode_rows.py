"""Episodes of several branches through the loop: the real RolloutManager, data source, rewards,
filters and fully_async workers see one sample per episode; the step's training rows and the
TrainBatch see every branch, one rollout per (episode, role).

The generator is a test plugin that returns a fixed two-agent episode at once (no engine, no
session server: these tests are about what the loop does with an episode's branches, not about
recording them; packages/miles-tito tests the session server that does).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from miles import hookimpl
from miles.config import MilesConfig
from miles.context import context_for
from miles.data.source import open_data_source
from miles.kernel import Kernel
from miles.loop.buffer import GroupBuffer
from miles.loop.modes.fully_async import batch_metrics, filter_pipeline
from miles.loop.producer import RolloutWorkers
from miles.loop.rollout import RolloutManager, StepRollout
from miles.plugins import PluginSelection
from miles.sections import RewardSection, RolloutSection, RunSection
from miles_contracts import Branch, ExitReason, GeneratorSpec, RewardSpec, Sample, Status, TrainBatch

PROMPT = [10, 11]


def _branch(episode: Sample, branch_id: int, tokens: list[int], loss_mask: list[int], *, role: str = "solver",
            cause: str, retried: bool = False) -> Sample:
    """A branch of ``episode``: the whole token path from the root, trained only where ``loss_mask`` is 1."""
    return Sample(tokens=tokens, response_length=len(loss_mask), loss_mask=loss_mask, response="...",
                  weight_versions=[0], token_versions=[0 if m else -1 for m in loss_mask], status=Status.COMPLETED,
                  branch=Branch(episode_id=f"episode-{episode.index}", branch_id=branch_id, parent_branch=0,
                                fork_turn=0, role=role, cause=cause, session_id=f"s{branch_id}", retried=retried))


async def two_agents(sample: Sample, ctx: object) -> Sample:
    """A solver episode (primary branch: prompt + 2 model tokens) with a compaction of its history,
    an abandoned retry and a critic sub-agent. Every fourth episode hits the per-episode limit."""
    sample.tokens, sample.response_length, sample.loss_mask = [*PROMPT, 20, 21], 2, [1, 1]
    sample.response, sample.weight_versions, sample.token_versions = "primary", [1], [1, 1]  # branches ran version 0
    sample.branch = Branch(episode_id=f"episode-{sample.index}", branch_id=0, role="solver", session_id="s0")
    sample.branches = [
        _branch(sample, 1, [*PROMPT, 20, 21, 40, 41, 42], [0, 1, 1], cause="compaction"),
        _branch(sample, 2, [*PROMPT, 20, 21, 70], [1], cause="retry", retried=True),
        _branch(sample, 3, [50, 51, 60, 61], [1, 1], role="critic", cause="subagent"),
    ]
    if sample.index % 4 == 3:
        return sample.finish(Status.TRUNCATED, ExitReason.EPISODE_LIMIT, "tito.max_branches")
    return sample.finish(Status.COMPLETED, ExitReason.STOP)


async def linear(sample: Sample, ctx: object) -> Sample:
    sample.tokens, sample.response_length, sample.loss_mask = [*PROMPT, 20], 1, [1]
    sample.response, sample.weight_versions = "4", [0]
    return sample.finish(Status.COMPLETED, ExitReason.STOP)


def solver_wins_on_even(samples: Sequence[Sample]) -> list[float | dict[str, float]]:
    """A zero-sum game: the solver wins the even episodes, the critic the odd ones."""
    return [{"solver": 1.0 - s.index % 2, "critic": float(s.index % 2)} if s.branch else 0.5 for s in samples]


class Episodes:
    @hookimpl
    def miles_register_generators(self, register):
        register("two_agents", GeneratorSpec(two_agents))
        register("linear", GeneratorSpec(linear))

    @hookimpl
    def miles_register_rewards(self, register):
        register("solver_wins_on_even", RewardSpec(solver_wins_on_even))


def _manager(generator: str, mode: str = "sync") -> RolloutManager:
    kernel = Kernel.load(PluginSelection(enable=("core", "data", "filters", "generators", "rewards")))
    kernel.register_plugin(Episodes(), "episodes")
    config = MilesConfig(run=RunSection(mode=mode),
                         rollout=RolloutSection(generator=generator, prompts_per_step=2, samples_per_prompt=2,
                                                concurrency=4, filters=["no_aborted"]),
                         reward=RewardSection(name="solver_wins_on_even"))
    ctx = context_for(config, kernel=kernel)
    return RolloutManager(ctx, open_data_source(ctx), engine=None, tokenizer=None)


def test_a_step_keeps_episodes_and_trains_every_branch_of_them(fresh_kernels: None) -> None:
    rollout = asyncio.run(_manager("two_agents").collect(1))

    # rewards, filters and groups see one sample per episode ...
    assert [[s.index for s in g] for g in rollout.groups] == [[0, 1], [2, 3]]
    assert rollout.metrics["rollout/samples"] == 4.0 and rollout.metrics["rollout/groups_kept"] == 2.0
    # ... the training rows are every branch of every kept episode, each episode's rows together
    rows = rollout.train_samples
    assert [(r.index, r.branch.branch_id) for r in rows if r.branch] == [(i, b) for i in range(4) for b in range(4)]
    assert [r.reward for r in rows[:4]] == [1.0, 1.0, 1.0, 0.0]  # episode 0: the solver's three rows won
    assert [r.reward for r in rows[4:8]] == [0.0, 0.0, 0.0, 1.0]

    batch = TrainBatch.from_samples(rows, pad_token_id=0)
    assert batch.size == 16
    assert batch.rollout_ids.tolist() == [0, 0, 0, 1, 2, 2, 2, 3, 4, 4, 4, 5, 6, 6, 6, 7]  # (episode, role)
    assert batch.group_ids.tolist() == [0, 0, 0, 1] * 2 + [2, 2, 2, 3] * 2  # (prompt group, role)
    # every model-written token is trained once: 2 primary + 2 compaction + 1 retry + 2 critic per episode
    assert batch.loss_mask.sum().item() == 4 * 7

    m = rollout.metrics
    assert m["rollout/episode_rows_mean"] == 4.0
    assert (m["rollout/role/solver/rows"], m["rollout/role/critic/rows"]) == (12.0, 4.0)
    assert m["rollout/role/solver/reward_mean"] == 0.5 and m["rollout/role/critic/reward_mean"] == 0.5
    assert (m["rollout/forks_compaction"], m["rollout/forks_retry"], m["rollout/forks_subagent"]) == (4.0, 4.0, 4.0)
    assert "rollout/forks_root" not in m
    assert m["rollout/retried_branches"] == 4.0 and m["rollout/episode_limit"] == 1.0


def test_a_run_without_branches_trains_and_reports_what_it_always_did(fresh_kernels: None) -> None:
    rollout = asyncio.run(_manager("linear").collect(1))
    assert rollout.train_samples == [s for g in rollout.groups for s in g]
    assert not [k for k in rollout.metrics if "role/" in k or "episode" in k or "forks_" in k or "retried" in k]
    batch = TrainBatch.from_samples(rollout.train_samples, pad_token_id=0)
    assert batch.rollout_ids.tolist() == [0, 1, 2, 3] and batch.group_ids.tolist() == [0, 0, 1, 1]


def test_a_failed_episode_trains_none_of_its_branches() -> None:
    episode = Sample(tokens=[*PROMPT, 20], response_length=1, loss_mask=[1], status=Status.COMPLETED,
                     branch=Branch(episode_id="e", branch_id=0))
    episode.branches = [_branch(episode, 1, [*PROMPT, 20, 30], [1], cause="rewrite")]
    episode.finish(Status.FAILED, ExitReason.REWARD_ERROR, "the reward raised")
    episode.branches[0].reward = 1.0  # a generator that scored the branch itself
    assert StepRollout([[episode]], [episode]).train_samples == []


def test_fully_async_batches_train_every_branch_and_report_them(fresh_kernels: None) -> None:
    """The fully_async path: workers score episodes into the buffer; a batch's rows and metrics
    expand them as the synchronous step does."""
    manager = _manager("two_agents", mode="fully_async")
    buffer = GroupBuffer(4, admit=filter_pipeline(["no_aborted"], manager.kernel))
    workers = RolloutWorkers(manager, buffer, version=lambda: 0)

    async def scenario() -> list:
        workers.start()
        try:
            return await buffer.take(2, version=1)
        finally:
            await workers.stop()

    groups = asyncio.run(asyncio.wait_for(scenario(), timeout=30))
    rows = StepRollout([g.samples for g in groups], []).train_samples
    assert len(rows) == 2 * 2 * 4 and all(r.trainable for r in rows)  # groups x episodes x branches
    metrics = batch_metrics(groups, buffer, version=1, waited=0.0, interval=1.0)
    assert metrics["rollout/episode_rows_mean"] == 4.0 and metrics["rollout/role/critic/rows"] == 4.0
    # every branch's sampled tokens count in the lag: per episode 2 of version 1, 5 of version 0
    assert metrics["async/token_lag_mean"] == pytest.approx(5 / 7) and metrics["async/offpolicy_token_frac"] == pytest.approx(5 / 7)


def test_the_step_dump_keeps_every_branch_of_an_episode(fresh_kernels: None, tmp_path) -> None:
    """A run's samples/ files are the post-mortem: an episode's branches, roles and per-role
    rewards are in its line, not only its primary branch."""
    import json

    from miles.loop.run_dir import dump_samples

    rollout = asyncio.run(_manager("two_agents").collect(1))
    path = dump_samples(tmp_path, 1, rollout.all_samples, tokens=True)
    first = json.loads(path.read_text().splitlines()[0])
    assert first["branch"]["role"] == "solver" and first["role_rewards"] == {"solver": 1.0, "critic": 0.0}
    assert [(b["branch"]["cause"], b["branch"]["role"], b["reward"]) for b in first["branches"]] == [
        ("compaction", "solver", 1.0), ("retry", "solver", 1.0), ("subagent", "critic", 0.0)]
    assert first["branches"][0]["tokens"] == [*PROMPT, 20, 21, 40, 41, 42] and first["branches"][0]["loss_mask"] == [0, 1, 1]


def test_forks_are_counted_from_the_graph_even_where_a_branch_trains_nothing() -> None:
    """A retried attempt is not trained by default, so it has no row; the episode's graph (what the
    agentic generator records in ``metadata["episode"]``) still counts it as a fork."""
    from miles.loop.episodes import episode_metrics

    episode = Sample(tokens=[1, 2, 3], response_length=1, loss_mask=[1], rollout_logprobs=[0.0], reward=1.0,
                     status=Status.COMPLETED, metadata={"episode": {"forks": {"retry": 1, "compaction": 2}}},
                     branch=Branch(episode_id="e", branch_id=0))
    episode.branches = [_branch(episode, 2, [1, 2, 3, 4], [0, 1], cause="compaction")]
    metrics = episode_metrics([episode])
    assert (metrics["rollout/forks_retry"], metrics["rollout/forks_compaction"]) == (1.0, 2.0)
    assert metrics["rollout/retried_branches"] == 1.0 and metrics["rollout/episode_rows_mean"] == 2.0
    del episode.metadata["episode"]  # no graph recorded: the rows' own causes
    rows_only = episode_metrics([episode])
    assert rows_only.get("rollout/forks_retry") is None and rows_only["rollout/forks_compaction"] == 1.0
