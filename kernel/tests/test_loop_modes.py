"""The loop modes are one table (miles.loop.modes): every ``run.mode`` the config accepts has a
strategy, and what a mode implies for the rest of the run is asked of it, not of its name."""

from __future__ import annotations

import typing

from miles.config import MilesConfig
from miles.loop.modes import MODES, loop_mode
from miles.sections import RolloutSection, RunSection


def test_every_mode_the_config_accepts_has_a_strategy() -> None:
    accepted = set(typing.get_args(RunSection.model_fields["mode"].annotation))
    assert accepted == set(MODES)
    for name in accepted:
        mode = loop_mode(MilesConfig(run=RunSection(mode=name)))
        assert mode.name == name and callable(mode.run)


def test_only_fully_async_continues_generations_across_weight_updates() -> None:
    def partial(mode: str, on: bool) -> bool:
        config = MilesConfig(run=RunSection(mode=mode), rollout=RolloutSection(partial_rollout=on))
        return loop_mode(config).partial_rollout(config)

    assert [partial(mode, True) for mode in ("sync", "one_step_off", "fully_async")] == [False, False, True]
    assert partial("fully_async", False) is False


def test_the_step_loop_modules_use_only_the_public_step_operations() -> None:
    """A mode drives StepOps; none reaches into the runner (the import cycle fully_async had)."""
    import inspect

    for mode in MODES.values():
        source = inspect.getsource(inspect.getmodule(mode.run))
        assert "miles.loop.runner" not in source and "._" not in source.replace("self._", ""), mode.name
