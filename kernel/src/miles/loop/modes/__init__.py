"""Loop modes: when each step operation happens. The one place that reads ``run.mode``.

A mode is a small strategy over :class:`~miles.loop.steps.StepOps` (rollout, train, sync
weights, evaluate, checkpoint, log); the :class:`~miles.loop.runner.Run` owns the life cycle
around it (start, stop, restore, faults). Each mode also says how the rest of the run must behave
under it -- whether a generation a weight update aborted goes on (the generators and the session
server ask :meth:`LoopMode.partial_rollout`) -- and which settings it cannot honour, so that
nothing else in the tree compares mode names.

============== ============================================ =====================================
mode           schedule                                     module
============== ============================================ =====================================
sync           rollout k, train k, sync                     :mod:`miles.loop.modes.sync`
one_step_off   rollout k+1 beside training k, sync after it :mod:`miles.loop.modes.one_step_off`
fully_async    rollout all the time into a bounded buffer   :mod:`miles.loop.modes.fully_async`
============== ============================================ =====================================
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles.loop.modes import fully_async, one_step_off, sync

if TYPE_CHECKING:
    from miles.config import MilesConfig
    from miles.loop.steps import StepOps

LoopRun = Callable[["StepOps"], Coroutine[Any, Any, None]]
"""A mode's ``async run(ops)``: drives the steps until ``run.steps`` are done or the run is stopped."""


@dataclass(frozen=True, slots=True)
class LoopMode:
    """One ``run.mode``.

    :ivar name: the value of ``run.mode``.
    :ivar run: the mode's ``async run(ops)`` (which also decides whether training leaves the event
        loop free for rollouts: ``ops.train(rollout, in_thread=...)``).
    :ivar continues_aborted: a generation a weight update aborts goes on under the new weights
        when ``rollout.partial_rollout`` is on (weights change under every generation).
    :ivar releases_engine_memory: the mode lets the engines give their memory back while the
        trainer trains (``resources.release_engine_memory``), which needs rollout and training to
        take turns; under any other mode that setting is an error.
    :ivar reads: settings only this mode reads (setting them under another mode is an error).
    :ivar checks: the mode's own config errors.
    :ivar trains_stale: why, under ``config``, the trainer can train on tokens sampled by older
        weights than its own (staleness above 0), naming the settings; None when it cannot. Such a
        run needs an importance correction (``algorithm.correction``).
    """

    name: str
    run: LoopRun
    continues_aborted: bool = False
    releases_engine_memory: bool = False
    reads: tuple[str, ...] = ()
    checks: Callable[[MilesConfig], list[str]] | None = None
    trains_stale: Callable[[MilesConfig], str | None] | None = None

    def partial_rollout(self, config: MilesConfig) -> bool:
        """Whether generations continue across weight updates in this run."""
        return self.continues_aborted and config.rollout.partial_rollout

    def config_errors(self, config: MilesConfig) -> list[str]:
        """Settings of ``config`` this mode cannot honour (each with the fix)."""
        errors = [f"{setting} ({_value(config, setting)}) applies to run.mode {owner.name} only; run.mode is "
                  f"{self.name!r}" for owner in MODES.values() if owner is not self for setting in owner.reads
                  if _is_set(config, setting)]
        release = config.resources.release_engine_memory
        if release != "none" and not self.releases_engine_memory:
            errors.append(f"resources.release_engine_memory ({release}) needs rollout and training to take turns "
                          f"(run.mode sync), but run.mode {self.name} generates while the trainer trains, so the "
                          f"engines use their memory all the time; use run.mode: sync, or "
                          f"resources.release_engine_memory: none")
        stale = self.trains_stale(config) if self.trains_stale is not None else None
        # reusing the rollout's log-probs makes them the old policy: PPO's ratio is then taken against the
        # weights that sampled each token, which is the correction (docs/design/true-on-policy.md)
        if stale is not None and config.algorithm.correction == "none" and not config.train.reuse_rollout_logprobs:
            errors.append(f"algorithm.correction is none, but {stale}: an uncorrected loss treats those tokens as the "
                          f"trainer's own; set algorithm.correction: tis (or mis), which weighs each token by how far "
                          f"the trainer has moved from the weights that sampled it")
        if self.checks is not None:
            errors += self.checks(config)
        return errors


def _value(config: MilesConfig, setting: str) -> object:
    section, key = setting.split(".")
    return config.to_dict()[section][key]


def _is_set(config: MilesConfig, setting: str) -> bool:
    """A mode-only setting away from its default."""
    section, key = setting.split(".")
    return bool(_value(config, setting) != type(getattr(config, section)).model_fields[key].default)


def _fully_async_errors(cfg: MilesConfig) -> list[str]:
    errors = []
    if cfg.rollout.concurrency < cfg.rollout.samples_per_prompt:
        errors.append(f"rollout.concurrency ({cfg.rollout.concurrency}) must be at least rollout.samples_per_prompt "
                      f"({cfg.rollout.samples_per_prompt}) in fully_async mode: a group's samples are in flight together")
    if cfg.run.deterministic:
        errors.append("run.deterministic cannot hold in run.mode fully_async: which weights sample a token, and "
                      "which groups make a batch, depend on timing; use sync or one_step_off for reproducible runs")
    return errors


def _one_step_off_stale(cfg: MilesConfig) -> str:
    return "run.mode one_step_off trains each step on samples of the weights one update older than the trainer's"


def _fully_async_stale(cfg: MilesConfig) -> str | None:
    """Staleness stays 0 only with ``rollout.max_staleness: 0``: the workers then launch no group
    that the trainer will not take before its next push, so none is in flight across one."""
    bound = cfg.rollout.max_staleness
    if bound == 0:
        return None
    setting = "unset (no bound)" if bound is None else str(bound)
    return f"run.mode fully_async with rollout.max_staleness {setting} trains on tokens sampled by older weights"


MODES: dict[str, LoopMode] = {mode.name: mode for mode in (
    LoopMode("sync", sync.run, releases_engine_memory=True),
    LoopMode("one_step_off", one_step_off.run, trains_stale=_one_step_off_stale),
    LoopMode("fully_async", fully_async.run, continues_aborted=True,
             reads=("weights.update_interval", "rollout.max_staleness", "rollout.late_groups"),
             checks=_fully_async_errors, trains_stale=_fully_async_stale),
)}


def loop_mode(config: MilesConfig) -> LoopMode:
    """The mode ``run.mode`` names (the config model allows only these names)."""
    return MODES[config.run.mode]


__all__ = ["MODES", "LoopMode", "loop_mode"]
