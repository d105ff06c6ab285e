"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): save sharded, resume exactly.

Layout of a checkpoint folder::

    <path>/
      .metadata, __*_*.distcp   DCP: model and optimiser state of every trained module, sharded
      trainer_state.json        step, scheduler states, the caller's extra_state (written by rank 0)
      rng/rank_<r>.pt           RNG states of each rank (torch, CUDA, Python, NumPy)

Loading unpickles nothing unchecked: DCP's ``.metadata``, its non-tensor values and the RNG files
go through :mod:`miles.trainer.safe_checkpoint` (shared with miles-megatron); the rest is JSON.

``trainer_state.json`` is deleted when a save starts and written (atomically) when every rank is
done, so an interrupted save is never loaded as complete; other files in the folder (the
caller's) are left alone. DCP reshards on load, so a checkpoint can resume on a different number
of ranks (RNG files of missing ranks are then skipped).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from miles.trainer.safe_checkpoint import SafeFileSystemReader, SafeLoadPlanner, load_plain, refusals_surface

from miles_fsdp.distributed import DistContext, barrier

FORMAT_VERSION = 1
STATE_FILE = "trainer_state.json"  # written last: its presence marks a complete checkpoint
EXTRA_FILE = "extra_state.json"


@dataclass(slots=True)
class TrainedModule:
    """A module with its optimiser and scheduler, saved under ``name``. ``trained_only``: save and
    load the parameters that train (LoRA adapters), not the frozen ones, which are re-read from
    the model they came from."""

    name: str
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    trained_only: bool = False

    def state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_sd, optim_sd = get_state_dict(self.module, self.optimizer,
                                            options=StateDictOptions(ignore_frozen_params=self.trained_only))
        if self.trained_only:  # a tied alias of a frozen weight (lm_head) slips through ignore_frozen_params
            trained = {name for name, p in self.module.named_parameters() if p.requires_grad}
            model_sd = {name: value for name, value in model_sd.items() if name in trained}
        return model_sd, optim_sd

    def set_state_dicts(self, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        # strict=False with trained_only: the frozen keys are absent from the checkpoint on purpose
        options = StateDictOptions(ignore_frozen_params=self.trained_only, strict=not self.trained_only)
        set_state_dict(self.module, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=options)


def _rng_state(device: torch.device) -> dict[str, Any]:
    # stored as tensors and plain numbers only, so it loads with torch.load(weights_only=True)
    import numpy as np  # a dependency of transformers

    # legacy=True is the default, spelled out: numpy's stub types the bare call as the dict form
    legacy = np.random.get_state(legacy=True)
    assert isinstance(legacy, tuple), "the global RandomState is an MT19937, whose legacy state is a tuple"
    kind, keys, pos, has_gauss, cached = legacy
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: Mapping[str, Any], device: torch.device) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _json_or_error(extra_state: Mapping[str, Any]) -> str:
    try:
        return json.dumps(dict(extra_state))
    except TypeError as exc:
        raise TypeError(
            f"extra_state must be JSON-serialisable (dicts, lists, str, numbers, bools, None): {exc}; "
            f"convert the offending value (e.g. a tensor with .tolist()) before saving"
        ) from None


def save_checkpoint(path: Path, modules: list[TrainedModule], step: int, extra_state: Mapping[str, Any], dist_ctx: DistContext,
                    *, skipped_steps: int = 0) -> None:
    """Collective: every rank calls it with the same ``path`` (a folder, created if missing).
    ``step`` counts the optimizer steps taken, ``skipped_steps`` those skipped (a gradient that
    was not finite).

    Files of the caller already in ``path`` are left alone. ``trainer_state.json`` is removed
    first and written last, so a save that dies half-way is never loaded as complete.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    extra_json = _json_or_error(extra_state)  # fail before touching anything
    marker = path / STATE_FILE
    if dist_ctx.is_main:
        path.mkdir(parents=True, exist_ok=True)
        marker.unlink(missing_ok=True)
    barrier()

    state: dict[str, Any] = {}
    for m in modules:
        state[m.name], state[f"{m.name}_optim"] = m.state_dicts()
    dcp.save(state, checkpoint_id=str(path))

    (path / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(dist_ctx.device), path / "rng" / f"rank_{dist_ctx.rank}.pt")
    barrier()
    if dist_ctx.is_main:
        trainer_state = {
            "format": FORMAT_VERSION,
            "step": step,
            "skipped_steps": skipped_steps,
            "world_size": dist_ctx.world_size,
            "schedulers": {m.name: m.scheduler.state_dict() for m in modules},
            "modules": [m.name for m in modules],
        }
        (path / EXTRA_FILE).write_text(extra_json)
        partial = marker.with_suffix(".partial")
        partial.write_text(json.dumps(trainer_state, indent=2))
        partial.rename(marker)
    barrier()


def load_checkpoint(path: Path, modules: list[TrainedModule], dist_ctx: DistContext) -> tuple[int, int, dict[str, Any]]:
    """Collective. Restores modules, optimisers, schedulers and RNG; returns ``(step, skipped_steps, extra_state)``."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise FileNotFoundError(
            f"{path} is not a miles-fsdp checkpoint (no trainer_state.json); pass a folder written by save_checkpoint"
        )
    trainer_state = json.loads(state_file.read_text())
    if trainer_state.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {trainer_state.get('format')} is not {FORMAT_VERSION}")
    missing = [m.name for m in modules if m.name not in trainer_state["modules"]]
    if missing:
        raise ValueError(
            f"{path} has no state for {', '.join(missing)} (it holds {', '.join(trainer_state['modules'])}); "
            f"resume with the same train.use_critic setting it was saved with"
        )

    state: dict[str, Any] = {}
    for m in modules:
        state[m.name], state[f"{m.name}_optim"] = m.state_dicts()
    # through the checks of safe_checkpoint: a folder given to --resume may come from anywhere
    with refusals_surface():
        dcp.load(state, storage_reader=SafeFileSystemReader.checked(path), planner=SafeLoadPlanner())
    for m in modules:
        m.set_state_dicts(state[m.name], state[f"{m.name}_optim"])
        m.scheduler.load_state_dict(trainer_state["schedulers"][m.name])

    rng_file = path / "rng" / f"rank_{dist_ctx.rank}.pt"
    if rng_file.is_file():
        _set_rng_state(load_plain(rng_file), dist_ctx.device)
    extra = json.loads((path / EXTRA_FILE).read_text())
    return int(trainer_state["step"]), int(trainer_state.get("skipped_steps", 0)), extra
