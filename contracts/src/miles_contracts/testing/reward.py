"""Conformance suite for reward functions: ``check_reward(fn)``.

A reward (see :class:`miles_contracts.RewardFn`) must

- return a list with one number per sample, in the order given, for batches of any size,
  the empty batch included;
- give a sample the same score whatever batch it is scored in (when ``deterministic``);
- return NaN -- not raise -- for a sample it cannot score (no label, an empty or absurd response);
- leave the samples unchanged (the kernel writes ``sample.reward``);
- be safe to call concurrently: several calls in flight at once (``asyncio.gather`` for an async
  reward, threads for a sync one) give the same scores as one call after another.

Usage::

    from miles_contracts.testing.reward import check_reward

    def test_my_reward_conforms():
        check_reward(my_reward, samples=typical_samples())
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import math
import numbers
from collections.abc import Awaitable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from miles_contracts.protocols import RewardFn
from miles_contracts.sample import Sample, Status
from miles_contracts.specs import RewardSpec

CONCURRENT_CALLS = 4


def typical_samples() -> list[Sample]:
    """Ordinary scorable samples: right and wrong answers in a few common formats."""
    cases = [
        ("What is 2 + 3?", "5", "5"),
        ("What is 7 - 1?", "The answer is 6.", "6"),
        ("What is 4 * 4?", "I think it is 15", "16"),
        ("Compute 9 + 9.", "\\boxed{18}", "18"),
        ("Name the capital of France.", "Paris", "Paris"),
        ("Name the capital of Italy.", "Milan", "Rome"),
    ]
    return [
        Sample(prompt=[{"role": "user", "content": p}], response=r, label=label, status=Status.COMPLETED, index=i)
        for i, (p, r, label) in enumerate(cases)
    ]


def edge_samples() -> list[Sample]:
    """Samples a reward may be unable to score; it must answer NaN or a number, never raise."""
    return [
        Sample(prompt="no label", response="42", label=None, status=Status.COMPLETED, index=100),
        Sample(prompt="empty response", response="", label="1", status=Status.COMPLETED, index=101),
        Sample(prompt="truncated", response="Let me think step by step about", label="3", status=Status.TRUNCATED, index=102),
        Sample(prompt="long", response="1 + " * 300 + "1", label="301", status=Status.COMPLETED, index=103),
        Sample(prompt="unicode", response="答案是 ½ ∞ \\boxed{\\frac{1}{0}}", label="\\infty", status=Status.COMPLETED, index=104),
        Sample(prompt="braces", response="\\boxed{{{", label="}", status=Status.COMPLETED, index=105),
        Sample(prompt="metadata", response="7", label="7", status=Status.COMPLETED, index=106, metadata={"nested": {"a": [1, 2]}}),
    ]


def check_reward(reward: RewardSpec | RewardFn, samples: Sequence[Sample] | None = None, *,
                 deterministic: bool = True) -> None:
    """Raise ``AssertionError`` naming the first rule the reward breaks.

    :param reward: what the plugin registers (a :class:`~miles_contracts.RewardSpec`: its unbound
        ``score`` is checked), or the reward function itself.
    :param samples: typical samples for this reward (default :func:`typical_samples`); the suite
        adds :func:`edge_samples`.
    :param deterministic: whether the same sample always gets the same score (turn off for
        rewards that sample, e.g. a random baseline).
    """
    fn = reward.score if isinstance(reward, RewardSpec) else reward
    typical = list(samples) if samples is not None else typical_samples()
    every = typical + edge_samples()
    name = getattr(fn, "__name__", type(fn).__name__)

    assert_scores(name, [], call(fn, []))
    for sample in every:
        try:
            scores = call(fn, [sample])
        except Exception as exc:
            raise AssertionError(
                f"reward {name} raised {type(exc).__name__} for sample {sample.index} ({sample.prompt!r}): {exc}; "
                f"return NaN for a sample that cannot be scored"
            ) from exc
        assert_scores(name, [sample], scores)
    before = [copy.deepcopy(s.to_dict()) for s in every]
    together = call(fn, every)
    assert_scores(name, every, together)
    after = [s.to_dict() for s in every]
    for old, new in zip(before, after, strict=True):
        assert old == new, f"reward {name} modified sample {old['index']}: {old} became {new}"
    if not deterministic:
        return

    alone = [call(fn, [s])[0] for s in every]
    assert same(together, alone), f"reward {name}: scores in one batch {together} differ from scores one by one {alone}"
    backwards = call(fn, every[::-1])
    assert same(backwards[::-1], together), (
        f"reward {name}: scores do not follow the samples' order (reversed batch gave {backwards[::-1]} after reordering, "
        f"expected {together})"
    )
    chunks = [every[i::CONCURRENT_CALLS] for i in range(CONCURRENT_CALLS)]
    sequential = [call(fn, chunk) for chunk in chunks]
    concurrent = call_concurrently(fn, chunks)
    assert all(same(a, b) for a, b in zip(concurrent, sequential, strict=True)), (
        f"reward {name} is not safe to call concurrently: concurrent calls gave {concurrent}, one after another {sequential}"
    )


def call(fn: RewardFn, batch: list[Sample]) -> Any:
    result = fn(batch)
    if inspect.isawaitable(result):
        result = asyncio.run(_await(result))
    return result


def call_concurrently(fn: RewardFn, batches: list[list[Sample]]) -> list[Any]:
    if is_async(fn):

        async def gather() -> list[Any]:
            # an async reward's call returns an awaitable (is_async checked it)
            return list(await asyncio.gather(*(cast(Awaitable[list[float]], fn(b)) for b in batches)))

        return asyncio.run(gather())
    with ThreadPoolExecutor(max_workers=len(batches)) as pool:
        return list(pool.map(lambda b: call(fn, b), batches))


def is_async(fn: object) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


async def _await(awaitable: Any) -> Any:
    return await awaitable


def assert_scores(name: str, batch: Sequence[Sample], scores: Any) -> None:
    assert isinstance(scores, list), f"reward {name} returned {type(scores).__name__}; expected a list of floats"
    assert len(scores) == len(batch), f"reward {name} returned {len(scores)} scores for {len(batch)} samples"
    for sample, score in zip(batch, scores, strict=True):
        assert isinstance(score, numbers.Real) and not isinstance(score, bool), (
            f"reward {name} scored sample {sample.index} ({sample.response[:40]!r}) with {score!r}; expected a float "
            f"(NaN when it cannot score)"
        )


def same(a: Sequence[float], b: Sequence[float]) -> bool:
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b, strict=True))
