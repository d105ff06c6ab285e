"""Checkpoints with megatron-core's distributed checkpointing: sharded, resumable at another layout.

Layout of a checkpoint folder::

    <path>/
      megatron/              dist_checkpointing: every chunk's weights and the optimizer state,
                             as global (layout-free) tensors, each saved once
      rng/rank_<r>.pt        RNG states of each rank
      extra_state.json       the caller's extra_state
      trainer_state.json     step and layout (written last: marks a complete checkpoint)

Weights and optimizer state are saved as global tensors (the distributed optimizer in its
``fully_reshardable`` form), so a checkpoint saved with one TP / PP / DP layout loads with
another; megatron-core reshards on load. RNG files of ranks that did not exist are skipped.

Loading unpickles nothing unchecked: megatron-core's files go through :mod:`miles_megatron.safe_load`,
the RNG files through :func:`miles.trainer.safe_checkpoint.load_plain`; the rest is JSON.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from miles.trainer.safe_checkpoint import load_plain

from miles_megatron.parallel import Ranks, barrier

FORMAT_VERSION = 1
STATE_FILE = "trainer_state.json"
EXTRA_FILE = "extra_state.json"
_OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}


def _sharded_state(chunks: list[Any], optimizer: Any, *, loading: bool, keep: Callable[[str], bool] | None) -> dict[str, Any]:
    """``keep``: which model keys to include (None: all); a LoRA run keeps its adapters only."""
    models = {f"model{i}": {k: v for k, v in chunk.sharded_state_dict().items() if keep is None or keep(k)}
              for i, chunk in enumerate(chunks)}
    flat: dict[str, Any] = {}
    for part in models.values():
        flat.update(part)
    state: dict[str, Any] = dict(models)
    state["optimizer"] = optimizer.sharded_state_dict(flat, is_loading=loading, metadata=_OPTIMIZER_SHARDING)
    return state


def _materialize_adam_state(optimizer: Any) -> None:
    """Give a fresh optimizer the state a first step would create (zero moments, step 0).

    Without Transformer Engine or Apex, megatron-core's distributed optimizer wraps
    ``torch.optim.AdamW``, which creates its state lazily; describing the state to load into then
    fails on an optimizer that never stepped. Zero moments at step 0 are exactly a fresh AdamW.
    """
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                                          "exp_avg_sq": torch.zeros_like(param)}


@contextlib.contextmanager
def _keep_adam_step(optimizer: Any) -> Iterator[None]:
    """Loading a ``fully_reshardable`` state into torch's AdamW keeps each parameter's ``step``.

    megatron-core 0.16 restores the (shared) ``step`` of torch's AdamW itself, leaves it out of the
    per-parameter tensors it reads from the checkpoint, then copies *every* key of the live state
    into place, ``step`` included, and fails on the missing one. Here a missing ``step`` is the
    value megatron-core just restored. Only the AdamW fallback (no Transformer Engine or Apex)
    has a per-parameter ``step``; with those optimizers nothing changes.
    """
    patched = []
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        original = getattr(part, "_set_main_param_and_optimizer_states", None)
        if original is None:
            continue

        def keep_step(model_param: Any, tensors: dict, part: Any = part, original: Any = original) -> None:
            group, order = part.model_param_group_index_map[model_param]
            state = part.optimizer.state[part.optimizer.param_groups[group]["params"][order]]
            if "step" in state and "step" not in tensors:
                tensors = {**tensors, "step": state["step"].clone()}
            original(model_param, tensors)

        part._set_main_param_and_optimizer_states = keep_step
        patched.append(part)
    try:
        yield
    finally:
        for part in patched:
            del part._set_main_param_and_optimizer_states


def _unshare_adam_steps(optimizer: Any) -> None:
    """Give every parameter its own AdamW ``step`` tensor again.

    megatron-core 0.16 restores torch AdamW's ``step`` as *one* tensor shared by all parameters;
    AdamW then increments it once per parameter, so every parameter after the first would see a
    wrong bias correction (a resumed run would drift from an uninterrupted one).
    """
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            for state in inner.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()


def _extra_json(extra_state: Mapping[str, Any]) -> str:
    try:
        return json.dumps(dict(extra_state))
    except TypeError as exc:
        raise TypeError(f"extra_state must be JSON-serialisable: {exc}; convert tensors with .tolist() before saving") from None


def _fork_result_queue() -> None:
    """Give megatron-core's checkpoint writer a result queue served by a forked process.

    ``FileSystemWriterAsync`` collects its writers' results through a ``Manager`` queue it
    creates in a *spawned* process: a fresh interpreter that re-imports the caller's main module
    (seconds per process, and a script without a ``__main__`` guard fails). A forked manager
    serves the same queue at once.
    """
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()


def _rng_state() -> dict[str, Any]:
    """This rank's random state as tensors only (loads with ``weights_only``): the CPU generator,
    and on a GPU the CUDA generator and megatron's model-parallel tracker (dropout inside TP
    regions draws from the tracker's streams)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        tracked = tensor_parallel.get_cuda_rng_tracker().get_states()
        # a CUDA-graph-safe tracker keeps torch.Generator objects, which only pickle: not saved
        state["tracker"] = {name: s for name, s in tracked.items() if isinstance(s, torch.Tensor)}
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tracker = tensor_parallel.get_cuda_rng_tracker()
        tracker.set_states({**tracker.get_states(), **state["tracker"]})


def save(path: Path, chunks: list[Any], optimizer: Any, step: int, layout: Any, extra_state: Mapping[str, Any], ranks: Ranks,
         *, skipped_steps: int = 0, keep: Callable[[str], bool] | None = None) -> None:
    """Collective: every rank calls it with the same ``path``. ``step`` counts optimizer steps taken,
    ``skipped_steps`` the ones skipped (a gradient that was not finite): the schedule advances on both."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    extra = _extra_json(extra_state)
    if ranks.is_main:
        path.mkdir(parents=True, exist_ok=True)
        (path / STATE_FILE).unlink(missing_ok=True)
        shutil.rmtree(path / "megatron", ignore_errors=True)
        (path / "megatron").mkdir()
        (path / "rng").mkdir(exist_ok=True)
    barrier()
    _fork_result_queue()
    dist_checkpointing.save(_sharded_state(chunks, optimizer, loading=False, keep=keep), str(path / "megatron"))
    torch.save(_rng_state(), path / "rng" / f"rank_{ranks.rank}.pt")
    barrier()
    if ranks.is_main:
        (path / EXTRA_FILE).write_text(extra)
        state = {"format": FORMAT_VERSION, "step": step, "skipped_steps": skipped_steps, "layout": repr(layout),
                 "world_size": ranks.world_size}
        partial = path / (STATE_FILE + ".partial")
        partial.write_text(json.dumps(state, indent=2))
        partial.rename(path / STATE_FILE)
    barrier()


def load(path: Path, chunks: list[Any], optimizer: Any, ranks: Ranks,
         keep: Callable[[str], bool] | None = None) -> tuple[int, int, dict[str, Any]]:
    """Collective. Restores weights, optimizer and RNG; returns ``(step, skipped_steps, extra_state)``."""
    from miles_megatron.safe_load import load_distributed, without_extra_state

    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a miles-megatron checkpoint (no {STATE_FILE}); pass a folder save_checkpoint wrote")
    trainer = json.loads((path / STATE_FILE).read_text())
    if trainer.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {trainer.get('format')} is not {FORMAT_VERSION}")
    _materialize_adam_state(optimizer)
    # a folder given to --resume may come from anywhere: every file through safe_load's checks
    loaded = load_distributed(_sharded_state(chunks, optimizer, loading=True, keep=keep), path / "megatron")
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(without_extra_state(loaded[f"model{i}"], f"{path}: model chunk {i}"), strict=False)
    with _keep_adam_step(optimizer):
        optimizer.load_state_dict(loaded["optimizer"])
    _unshare_adam_steps(optimizer)
    rng = path / "rng" / f"rank_{ranks.rank}.pt"
    if rng.is_file():
        _set_rng_state(load_plain(rng))
    return int(trainer["step"]), int(trainer.get("skipped_steps", 0)), json.loads((path / EXTRA_FILE).read_text())
