"""Built-in plugin ``rewards``: ``exact_match``, ``f1`` and ``remote``."""

from __future__ import annotations

from miles_contracts import RewardSpec

from miles.hookspecs import hookimpl
from miles.registry import Register
from miles.rewards.exact_match import exact_match
from miles.rewards.f1 import f1
from miles.rewards.remote import RemoteReward


@hookimpl
def miles_register_rewards(register: Register[RewardSpec]) -> None:
    register("exact_match", RewardSpec(exact_match))
    register("f1", RewardSpec(f1))
    remote = RemoteReward()  # unbound: the run's reward section gives it its URL
    register("remote", RewardSpec(remote, bind=remote.bind))
