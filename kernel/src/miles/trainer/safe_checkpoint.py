"""Reading checkpoint files without running what they hold.

``miles train --resume`` reads a folder the user points at, which may come from anywhere, and
torch's checkpoint formats are pickles: unpickling one may call any importable function
(``os.system`` ...). Both train backends read their checkpoints through this module:

* :meth:`SafeFileSystemReader.checked` reads the ``.metadata`` of a ``torch.distributed.checkpoint``
  (DCP) folder, which ``FileSystemReader.read_metadata`` reads with a plain ``pickle.load``. Its
  unpickler resolves only the dataclasses and enums of DCP's ``metadata`` and ``planner`` modules
  (megatron-core keeps its save plans, ``SavePlan`` and ``WriteItem``, in the metadata),
  ``torch.Size``, dtypes, layouts, paths and a few builtin containers. Any other global is refused
  before it is called, and so is a ``BUILD`` aimed at a class (a pickle could otherwise rewrite
  the attributes of a class it may name, for the rest of the process).
* :class:`SafeLoadPlanner` loads each non-tensor value of a DCP state dict (an optimizer's ``lr``,
  megatron-core's sharded objects), which ``DefaultLoadPlanner.load_bytes`` loads with
  ``torch.load(weights_only=False)``, with ``weights_only=True``, and hands it on only if that
  succeeded.
* :func:`load_plain` reads a single ``torch.save`` file (RNG states, megatron-core's ``common.pt``)
  with ``weights_only=True`` given explicitly: ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``, which turns
  torch's default off, cannot turn this off.
* :func:`refusals_surface` turns a refusal that DCP wrapped (it reports a rank's error inside a
  ``CheckpointException``, a ``BaseException`` holding every rank's traceback) back into an
  :class:`UnsafeCheckpointError`.

``weights_only`` admits tensors, plain containers and what the process registered with
``torch.serialization.add_safe_globals``: torch's DTensor classes and, once megatron-core is
imported, its config dataclasses, ``argparse.Namespace``, ``io.BytesIO`` and numpy arrays. Those
are data; none is a function a file can choose to call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
import io
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from miles.errors import MilesError

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_ALLOWED = frozenset({
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
})


class UnsafeCheckpointError(MilesError, ValueError):
    """A checkpoint file holds something other than tensors, plain data and its format's own metadata."""


def _format_class(module: str, name: str) -> type | None:
    """A dataclass or enum that DCP's metadata or planner module defines (not one it imports)."""
    found = getattr(importlib.import_module(module), name, None)
    if not isinstance(found, type) or found.__module__ != module:
        return None
    return found if dataclasses.is_dataclass(found) or issubclass(found, enum.Enum) else None


_PLAIN_BUILD: Any = pickle._Unpickler.dispatch[pickle.BUILD[0]]


def _guarded_build(unpickler: _MetadataUnpickler) -> None:
    target = unpickler.stack[-2]  # BUILD pops the state (stack[-1]) and applies it to this object
    if isinstance(target, type):
        raise UnsafeCheckpointError(f"refusing to set attributes of {target.__module__}.{target.__qualname__} in "
                                    f"{unpickler.source}: a checkpoint's metadata builds instances, never classes")
    _PLAIN_BUILD(unpickler)


class _MetadataUnpickler(pickle._Unpickler):
    # the Python unpickler, whose opcodes can be overridden (the C one's cannot): its BUILD is guarded
    dispatch: ClassVar[dict[int, Any]] = {**pickle._Unpickler.dispatch, pickle.BUILD[0]: _guarded_build}
    stack: list[Any]

    def __init__(self, stream: io.BufferedIOBase, source: Path) -> None:
        super().__init__(stream)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        found = _format_class(module, name) if module in _DCP_MODULES else None
        if found is not None:
            return found
        if (module, name) in _ALLOWED:
            return getattr(importlib.import_module(module), name)
        raise UnsafeCheckpointError(f"refusing {module}.{name} in {self.source}: a DCP checkpoint's metadata holds "
                                    "only DCP's own classes; was this folder written by miles?")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"refusing a persistent id in {self.source}")


def read_dcp_metadata(path: Path) -> Metadata:
    """The ``Metadata`` pickled in ``path`` (a DCP ``.metadata`` file), read by the restricted unpickler."""
    with open(path, "rb") as stream:
        metadata = _MetadataUnpickler(stream, path).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{path} does not hold DCP metadata (found a {type(metadata).__name__})")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read by :func:`read_dcp_metadata` (what the base
    class does, minus the unrestricted ``pickle.load``), once per reader.

    Make it with :meth:`checked`: DCP catches an error of ``read_metadata``, falls back to a
    rank-local metadata file and reports both failures as one ``AssertionError`` string, so a
    refusal must be raised before DCP asks.
    """

    def __init__(self, path: str | Path, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self._read: dict[int | None, Metadata] = {}

    @classmethod
    def checked(cls, path: str | Path) -> SafeFileSystemReader:
        """A reader of ``path`` whose metadata is read, and refused if it must be, now."""
        reader = cls(path)
        reader.read_metadata()
        return reader

    def reset(self, checkpoint_id: str | os.PathLike[Any] | None = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id is not None:  # another folder
            self._read.clear()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank not in self._read:
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            self._read[rank] = read_dcp_metadata(Path(self.path) / name)
        metadata = self._read[rank]
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # a new one per load (reset)
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that admits a non-tensor value only if ``weights_only`` can load it.

    Other planners (megatron-core's ``MCoreLoadPlanner``) get the same check by deriving from both:
    this class comes first, so its ``load_bytes`` is the one that runs.
    """

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as exc:
            raise UnsafeCheckpointError(f"refusing the checkpoint value {read_item.dest_index.fqn!r}: it is not plain "
                                        f"data or tensors ({_reason(exc)})") from None
        # where DefaultLoadPlanner.load_bytes puts the value, without its second, unrestricted load
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load_plain(path: Path) -> Any:
    """``torch.load(path)`` admitting tensors and plain data only, on the CPU."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(f"refusing {path}: it holds more than tensors and plain data ({_reason(exc)})") from None


def _reason(exc: Exception) -> str:
    """What ``weights_only`` refused, without torch's advice around it (which suggests turning the check off)."""
    paragraphs = [p.strip() for p in str(exc).split("\n\n") if p.strip()]
    boilerplate = ("Weights only load failed", "Check the documentation")
    found = [p for p in paragraphs if not p.startswith(boilerplate)] or paragraphs or [type(exc).__name__]
    return " ".join(found)[:300]


@contextlib.contextmanager
def refusals_surface() -> Iterator[None]:
    """Re-raise an :class:`UnsafeCheckpointError` that DCP wrapped in its ``CheckpointException``
    as itself, so the caller sees the refusal, not a traceback per rank."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        for failure, _trace in exc.failures.values():
            if isinstance(failure, UnsafeCheckpointError):
                raise UnsafeCheckpointError(str(failure)) from None
        raise
