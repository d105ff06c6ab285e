"""megatron-core's distributed checkpoint, read without running what its files hold.

``dist_checkpointing.load`` of a ``torch_dist`` checkpoint reads, by default:

* ``metadata.json``: JSON naming the formats of the rest, which picks the strategies that read
  it. Miles writes ``torch_dist`` (sharded) and ``torch`` (common) and reads nothing else: the
  strategies are given, and another format is refused by name.
* ``common.pt``: the state that is not sharded (the optimizer's param groups), with ``torch.load``
  at torch's default ``weights_only``, which ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` turns off.
  Here: :func:`~miles.trainer.safe_checkpoint.load_plain`.
* ``.metadata``: DCP's metadata pickle, through ``FileSystemReader.read_metadata`` (a plain
  ``pickle.load``). Here: :meth:`~miles.trainer.safe_checkpoint.SafeFileSystemReader.checked`.
* the ``.distcp`` files: tensors, and the bytes of sharded objects (each layer's
  ``_extra_state``), which ``DefaultLoadPlanner.load_bytes`` loads with ``weights_only=False``.
  Here: the ``load_bytes`` of :class:`~miles.trainer.safe_checkpoint.SafeLoadPlanner`.

megatron-core's ``TorchDistLoadShardedStrategy.load`` builds its reader (``_get_filesystem_reader``)
and planner (``MCoreLoadPlanner``) itself, with no argument to pass others, so
:class:`_RestrictedTorchDistLoad` replaces those two names of its module while it loads (ranks load
on one thread) and puts them back after. Should a megatron-core release rename them, loading stops
with an error instead of reading unchecked.

A layer's ``_extra_state`` is the last step: Transformer Engine's ``set_extra_state`` runs
``pickle.loads`` on a non-empty byte tensor (its FP8 scaling state). Miles trains without FP8, so
the state it saves is empty (``None``, or an empty tensor); :func:`without_extra_state` refuses
anything else and drops the rest, so no layer ever decodes one.
"""

from __future__ import annotations

import io
import json
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import torch as torch_dist
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
from miles.trainer.safe_checkpoint import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    load_plain,
    refusals_surface,
)

FORMATS = {"sharded_backend": "torch_dist", "common_backend": "torch"}
_FORMAT_FILE = "metadata.json"  # megatron-core's name for it (dist_checkpointing.core.CONFIG_FNAME)
_EXTRA_STATE = "_extra_state"


class _SafeMCoreLoadPlanner(SafeLoadPlanner, torch_dist.MCoreLoadPlanner):
    """megatron-core's planner (its global-shape checks) with the restricted ``load_bytes``."""


def _safe_reader(checkpoint_dir: str | Path, cache_metadata: bool = False) -> SafeFileSystemReader:
    return SafeFileSystemReader.checked(checkpoint_dir)


class _RestrictedTorchDistLoad(torch_dist.TorchDistLoadShardedStrategy):
    """``TorchDistLoadShardedStrategy`` reading through the restricted reader and planner."""

    _SWAPPED = {"_get_filesystem_reader": _safe_reader, "MCoreLoadPlanner": _SafeMCoreLoadPlanner}

    def load(self, sharded_state_dict: Any, checkpoint_dir: Path) -> Any:
        missing = [name for name in self._SWAPPED if not hasattr(torch_dist, name)]
        if missing:
            raise RuntimeError(f"megatron-core's torch_dist strategy no longer has {missing}: miles_megatron.safe_load "
                               "cannot check what it reads; use the megatron-core version pyproject.toml pins")
        original = {name: getattr(torch_dist, name) for name in self._SWAPPED}
        try:
            for name, replacement in self._SWAPPED.items():
                setattr(torch_dist, name, replacement)
            return super().load(sharded_state_dict, checkpoint_dir)
        finally:
            for name, value in original.items():
                setattr(torch_dist, name, value)


class _RestrictedCommonLoad(TorchCommonLoadStrategy):
    """``common.pt`` with ``weights_only=True``, whatever the environment says."""

    def load_common(self, checkpoint_dir: str | Path) -> Any:
        path = Path(checkpoint_dir) / COMMON_STATE_FNAME
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: not a complete megatron-core checkpoint")
        return load_plain(path)

    def load_sharded_objects(self, sharded_objects_state_dict: Any, checkpoint_dir: str | Path) -> Any:
        # the torch_dist strategy reads sharded objects from the DCP files itself; never called
        raise UnsafeCheckpointError("sharded objects outside the DCP files are not read: a miles-megatron checkpoint "
                                    "keeps them inside")


def _check_formats(folder: Path) -> None:
    path = folder / _FORMAT_FILE
    try:
        formats = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read the checkpoint's formats ({exc}); pass a folder miles-megatron "
                         "saved") from None
    found = {key: formats.get(key) for key in FORMATS} if isinstance(formats, dict) else {}
    if found != FORMATS:
        raise ValueError(f"{path} names the formats {found}; miles-megatron saves and reads {FORMATS} only")


def load_distributed(sharded_state_dict: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``dist_checkpointing.load`` of ``folder`` with every file read through the checks above."""
    _check_formats(folder)
    with refusals_surface():
        loaded: dict[str, Any] = dist_checkpointing.load(sharded_state_dict, str(folder),
                                                          sharded_strategy=_RestrictedTorchDistLoad(),
                                                          common_strategy=_RestrictedCommonLoad())
    return loaded


def without_extra_state(state: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``state`` without its layers' ``_extra_state`` entries, each of which must be empty."""
    kept = {}
    for key, value in state.items():
        if not key.endswith(_EXTRA_STATE):
            kept[key] = value
        elif not _empty(value):
            raise UnsafeCheckpointError(
                f"refusing {where} {key}: it holds a layer's extra state ({type(value).__name__}), which Transformer "
                "Engine would unpickle; Miles trains without FP8 and saves none")
    return kept


def _empty(value: Any) -> bool:
    """None (megatron-core's local layers), an empty tensor (Transformer Engine 2) or a ``torch.save``
    of None (Transformer Engine 1)."""
    if value is None:
        return True
    if isinstance(value, torch.Tensor):
        return value.numel() == 0
    if isinstance(value, io.BytesIO):
        value.seek(0)
        try:
            return torch.load(value, map_location="cpu", weights_only=True) is None
        except pickle.UnpicklingError:
            return False
    return False
