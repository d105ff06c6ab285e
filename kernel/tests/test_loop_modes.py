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


def test_the_resync_watcher_gives_a_restarted_engine_the_weights_while_the_trainer_waits() -> None:
    """fully_async's watcher on its own (its end-to-end trigger, a lone engine restarted while the
    trainer waits with nothing to train, is rare under launch pacing): a run whose engines are
    stale gets them synced within a period, once per period, and the watcher ends with the run.
    The run here is a stand-in with the two members the watcher reads (StepOps needs a trainer)."""
    import asyncio

    from miles.loop.modes.fully_async import _resync_restarted_engines

    class Run:
        def __init__(self) -> None:
            self.stale_engines = ["engine-0"]
            self.synced = 0

        def resync_restarted_engines(self) -> None:
            self.synced += 1
            self.stale_engines = []

    async def scenario() -> int:
        run, stop = Run(), asyncio.Event()
        watcher = asyncio.create_task(_resync_restarted_engines(run, stop, every=0.01))  # type: ignore[arg-type]
        for _ in range(500):
            if run.synced:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # more periods: nothing stale, nothing synced again
        stop.set()
        await asyncio.wait_for(watcher, 5)
        return run.synced

    assert asyncio.run(scenario()) == 1
