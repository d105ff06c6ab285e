"""Built-in plugin ``rewards``: ``exact_match``, ``f1`` and ``remote``."""

from __future__ import annotations

from miles.hookspecs import hookimpl
from miles.registry import Register
from miles.rewards.exact_match import exact_match
from miles.rewards.f1 import f1
from miles.rewards.remote import RemoteReward


@hookimpl
def miles_register_rewards(register: Register) -> None:
    register("exact_match", exact_match)
    register("f1", f1)
    register("remote", RemoteReward())
