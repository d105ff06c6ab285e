"""``score_samples``: what the RL loop calls to fill ``sample.reward`` for a step's samples.

Samples are grouped by reward name (``sample.metadata["reward"]``, else ``reward.name``); each
reward gets its samples as one batch and the batches run concurrently. Sync rewards run in a worker
thread so they never block the event loop (and with it the rollout). A reward that raises, times
out, or returns NaN / inf costs only the samples concerned: they become FAILED with exit reason
``reward_error`` and ``reward`` stays None. When a batch raises, each of its samples is scored
alone, so one bad sample does not fail its neighbours.

A reward may score an episode of several agents with ``{role: float}``: the sample's
``role_rewards`` become the mapping and its ``reward`` its own role's value (``sample.branch.role``);
a mapping without that role, or with a value that is not a finite number, fails the sample.

A reward's per-sample parameters are the row's ``settings.reward`` (validated by its
``RewardSpec.settings_model`` when the data was read): the reward reads them from the samples it is
given (``miles_contracts.settings.reward_settings``). With ``reward.overlong`` set, DAPO's overlong
penalty is added to every scored sample's reward (:mod:`miles.rewards.overlong`).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles_contracts import ExitReason, RewardFn, Sample, Status

from miles.registry import UnknownNameError
from miles.rewards.overlong import apply_overlong_penalty

if TYPE_CHECKING:
    from miles_contracts import RunContext

# Samples that never got a response are not scored.
UNSCORABLE_STATUSES = frozenset({Status.ABORTED, Status.FAILED})
# The kernel waits this fraction longer than reward.timeout, so rewards that enforce the timeout
# themselves (the math reward's worker pool) can still return the scores they finished in time.
TIMEOUT_GRACE = 0.1
MAX_REPORTED_ERRORS = 5


@dataclass(slots=True)
class ScoreReport:
    """What one :func:`score_samples` call did. ``metrics()`` is ready for the step's metrics."""

    scored: int = 0
    failed: int = 0
    skipped: int = 0
    overlong: int = 0  # scored samples the overlong penalty lowered
    seconds: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # the first few failure details

    def metrics(self) -> dict[str, float]:
        out = {"reward/scored": float(self.scored), "reward/failed": float(self.failed), "reward/skipped": float(self.skipped),
               "reward/overlong_penalized": float(self.overlong)}
        out.update({f"reward/{name}/seconds": s for name, s in self.seconds.items()})
        return out


def reward_name_of(sample: Sample, default: str) -> str:
    """The reward that scores ``sample``: its ``metadata["reward"]``, else ``default``."""
    name = sample.metadata.get("reward", default)
    if not isinstance(name, str):
        raise TypeError(f'metadata["reward"] of sample {sample.index} is {name!r}; expected the name of a registered reward')
    return name


async def score_samples(samples: Sequence[Sample], ctx: RunContext) -> ScoreReport:
    """Set ``reward`` on every sample that has a response; mark the ones that cannot be scored.

    :param samples: the step's samples (any mix of reward names).
    :param ctx: the run (its kernel's rewards; ``reward`` section: default name, timeout, remote URL).
    :raises UnknownNameError: a sample's ``metadata["reward"]`` names no registered reward.
    :raises TypeError: a sample's ``metadata["reward"]`` is not a name.
    """
    config = ctx.config.reward
    report = ScoreReport()
    batches: dict[str, list[Sample]] = {}
    for sample in samples:
        if sample.status in UNSCORABLE_STATUSES:
            report.skipped += 1
            continue
        batches.setdefault(reward_name_of(sample, config.name), []).append(sample)
    rewards = _resolve(ctx, batches)
    outcomes = await asyncio.gather(*(_timed(name, rewards[name], batch, config.timeout) for name, batch in batches.items()))
    for (name, batch), (seconds, results) in zip(batches.items(), outcomes, strict=True):
        report.seconds[name] = seconds
        for sample, (value, error) in zip(batch, results, strict=True):
            if value is not None:
                sample.reward, sample.role_rewards = value
                report.scored += 1
                if config.overlong is not None and apply_overlong_penalty(sample, config.overlong):
                    report.overlong += 1
            else:
                sample.reward, sample.role_rewards = None, {}
                sample.finish(Status.FAILED, ExitReason.REWARD_ERROR, error)
                report.failed += 1
                if len(report.errors) < MAX_REPORTED_ERRORS:
                    report.errors.append(f"sample {sample.index}: {error}")
    return report


def score_samples_blocking(samples: Sequence[Sample], ctx: RunContext) -> ScoreReport:
    """:func:`score_samples` for callers without an event loop."""
    return asyncio.run(score_samples(samples, ctx))


def _resolve(ctx: RunContext, batches: dict[str, list[Sample]]) -> dict[str, RewardFn]:
    config = ctx.config.reward
    registry = ctx.kernel.rewards()
    resolved = {}
    for name, batch in batches.items():
        if name not in registry:
            where = "reward.name" if name == config.name else f'metadata["reward"] of sample {batch[0].index}'
            raise UnknownNameError(f"{where}: {registry.unknown_message(name)}")
        spec = registry.get(name)
        resolved[name] = spec.bind(ctx) if spec.bind is not None else spec.score
    return resolved


Scored = tuple[float, dict[str, float]]  # (sample.reward, sample.role_rewards)
Result = tuple[Scored | None, str | None]  # (scored, None) or (None, why it failed)


async def _timed(name: str, reward: RewardFn, batch: list[Sample], timeout: float) -> tuple[float, list[Result]]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    results = await _score_batch(name, reward, batch, timeout)
    return loop.time() - start, results


async def _score_batch(name: str, reward: RewardFn, batch: list[Sample], timeout: float) -> list[Result]:
    try:
        values = await asyncio.wait_for(_call(reward, batch), timeout * (1 + TIMEOUT_GRACE))
    except TimeoutError:
        return [(None, f"reward {name!r} did not finish within {timeout} s (reward.timeout)")] * len(batch)
    except Exception as exc:  # noqa: BLE001 -- a reward's bug costs its samples, not the run
        if len(batch) > 1:
            alone = await asyncio.gather(*(_score_batch(name, reward, [s], timeout) for s in batch))
            return [results[0] for results in alone]
        return [(None, f"reward {name!r} raised {type(exc).__name__}: {exc}")]
    return [_checked(name, sample, value) for sample, value in zip(batch, values, strict=True)]


def _checked(name: str, sample: Sample, value: float | Mapping[Any, Any]) -> Result:
    """One sample's score, or why it cannot be its reward."""
    if isinstance(value, Mapping):
        return _checked_roles(name, sample, value)
    if not math.isfinite(value):
        return None, f"reward {name!r} returned {value} (the sample could not be scored)"
    return (value, {}), None


def _checked_roles(name: str, sample: Sample, value: Mapping[Any, Any]) -> Result:
    shown = repr(dict(value))[:200]
    role = sample.branch.role if sample.branch is not None else None
    if role is None:
        return None, (f"reward {name!r} returned per-role rewards {shown} for a sample without a role "
                      f"(sample.branch is None); return one float for an episode of one agent")
    bad = [key for key, v in value.items() if not isinstance(key, str) or isinstance(v, bool)
           or not isinstance(v, numbers.Real) or not math.isfinite(v)]
    if bad:
        return None, (f"reward {name!r} returned per-role rewards {shown}: the value of {bad[0]!r} is not a finite "
                      f"number; every role's reward must be one (a float per role)")
    if role not in value:
        return None, (f"reward {name!r} returned per-role rewards {shown} without the sample's own role {role!r}; "
                      f"the mapping must hold a reward for it")
    rewards = {key: float(v) for key, v in value.items()}
    return (rewards[role], rewards), None


async def _call(reward: RewardFn, batch: list[Sample]) -> list[float | Mapping[Any, Any]]:
    if _is_async(reward):
        result: Any = await reward(batch)  # type: ignore[misc]
    else:
        result = await asyncio.to_thread(reward, batch)
        if inspect.isawaitable(result):
            result = await result
    return _as_scores(result, len(batch))


def _is_async(fn: object) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _as_scores(result: Any, expected: int) -> list[float | Mapping[Any, Any]]:
    """The reward's answer as one score per sample; a mapping is checked per sample (:func:`_checked`)."""
    if not isinstance(result, list | tuple) or len(result) != expected:
        got = f"{len(result)} values" if isinstance(result, list | tuple) else type(result).__name__
        raise TypeError(f"returned {got} for {expected} samples; a reward returns one float per sample")
    scores: list[float | Mapping[Any, Any]] = []
    for value in result:
        if value is None:
            scores.append(math.nan)
        elif isinstance(value, Mapping):
            scores.append(value)
        elif isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"returned {value!r}; a reward returns floats (NaN for a sample it cannot score), "
                            f"or {{role: float}} for an episode of several agents")
        else:
            scores.append(float(value))
    return scores
