"""Miles plugin ``wandb``: the ``wandb`` tracker and the ``wandb`` config section.

wandb itself is imported only when a run starts the tracker.
"""

from __future__ import annotations

from miles import hookimpl
from miles.registry import Register
from miles_contracts import ConfigSectionSpec, TrackerSpec

from miles_tracker_wandb.config import WandbSection
from miles_tracker_wandb.tracker import wandb_tracker


@hookimpl
def miles_register_trackers(register: Register[TrackerSpec]) -> None:
    register("wandb", TrackerSpec(wandb_tracker))


@hookimpl
def miles_register_config_sections(register: Register[ConfigSectionSpec]) -> None:
    register("wandb", ConfigSectionSpec(WandbSection))
