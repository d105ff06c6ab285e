"""Loading a verifiers environment once per process, from the run's ``verifiers`` section."""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING

from miles_verifiers.section import VerifiersSection

if TYPE_CHECKING:
    from verifiers.legacy.envs.environment import Environment

_loaded: dict[str, Environment] = {}
_lock = threading.Lock()


class VerifiersConfigError(ValueError):
    """The ``verifiers`` section does not name an environment that loads."""


def load_environment(section: VerifiersSection) -> Environment:
    """The environment ``section`` names, built by its module's ``load_environment(**args)``; the
    same object for the same section (the data source and the agent share it in the driver)."""
    if not section.environment:
        raise VerifiersConfigError(
            "verifiers.environment is empty: set it to a verifiers environment id (an installed module with "
            "load_environment), e.g. verifiers.environment=miles_verifiers.demo_envs.sum_single_turn"
        )
    key = json.dumps([section.environment, section.args], sort_keys=True, default=str)
    with _lock:
        env = _loaded.get(key)
        if env is None:
            import verifiers as vf

            try:
                env = vf.load_environment(section.environment, **section.args)
            except (ValueError, RuntimeError) as exc:  # how vf.load_environment reports a missing or failing module
                raise VerifiersConfigError(
                    f"verifiers.environment={section.environment!r} does not load: {type(exc).__name__}: {exc}; "
                    f"install the environment's package (it must expose load_environment) and check verifiers.args"
                ) from exc
            _loaded[key] = env
        return env
