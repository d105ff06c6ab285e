"""``run.deterministic``: the sampling seed each sample sends to the engine."""

from __future__ import annotations

from miles.loop.rollout import sampling_seed


def test_each_sample_of_a_run_gets_its_own_stable_seed() -> None:
    seeds = [sampling_seed(0, index) for index in range(1000)]
    assert seeds == [sampling_seed(0, index) for index in range(1000)]  # a rerun or a resume sends the same
    assert len(set(seeds)) == 1000  # the samples of a group must not draw the same numbers
    assert all(0 <= s < 2**31 for s in seeds)  # an int32 every engine accepts
    assert sampling_seed(1, 0) != sampling_seed(0, 0)  # run.seed changes every stream
