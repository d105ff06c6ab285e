"""``guess_number``: a small OpenEnv environment written against openenv-core's public API, used by
this package's tests, ``miles bench conformance`` and the README.

``reset(seed)`` picks a secret number from 1 to ``HIGHEST``; each ``step`` takes a text ``message``,
reads its first whole number as the guess and answers ``higher`` / ``lower`` / ``correct``; reward
1.0 on the correct guess (the episode ends), 0.0 otherwise; the episode also ends after
``MAX_GUESSES`` guesses. Serve it with ``python -m miles_openenv.guess_number --port 8000``.
"""

from __future__ import annotations

import random
import re
from typing import Any
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

HIGHEST = 20
MAX_GUESSES = 4


class GuessAction(Action):
    """A guess, as text (the model's reply)."""

    message: str = Field(..., description="text whose first whole number is the guess")


class GuessObservation(Observation):
    """What the player is told."""

    prompt: str = Field(default="", description="the instruction or the answer to the last guess")
    guesses: int = Field(default=0, description="guesses so far")


class GuessNumberEnvironment(Environment):
    """Guess a secret number with higher / lower hints (one instance per WebSocket session)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._secret = 1

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self._secret = random.Random(seed).randint(1, HIGHEST)
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return GuessObservation(prompt=f"I picked a whole number from 1 to {HIGHEST}. Guess it: reply with one number.",
                                done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        found = re.search(r"-?\d+", action.message)
        if found is None:
            answer, correct = "That is not a number. Reply with one whole number.", False
        else:
            guess = int(found.group())
            correct = guess == self._secret
            answer = "Correct!" if correct else ("Higher." if guess < self._secret else "Lower.")
        done = correct or self._state.step_count >= MAX_GUESSES
        return GuessObservation(prompt=answer, guesses=self._state.step_count, done=done, reward=1.0 if correct else 0.0,
                                metadata={"secret": self._secret} if done else {})

    @property
    def state(self) -> State:
        return self._state


def create_guess_number_app(max_concurrent_envs: int = 256) -> Any:
    """The environment's FastAPI app (openenv-core's server: ``/ws`` sessions, ``/reset``, ``/step``, ``/health``)."""
    from openenv.core.env_server.http_server import create_fastapi_app

    return create_fastapi_app(GuessNumberEnvironment, GuessAction, GuessObservation, max_concurrent_envs=max_concurrent_envs)
