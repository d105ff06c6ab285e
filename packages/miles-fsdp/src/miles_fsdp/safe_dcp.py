"""Loading a ``torch.distributed.checkpoint`` folder without unpickling arbitrary objects.

DCP keeps two kinds of pickles in a checkpoint: the ``.metadata`` file (``pickle.load`` in
``FileSystemReader.read_metadata``) and every non-tensor value of the state dict, such as an
optimiser's ``lr`` or ``betas`` (``torch.load(..., weights_only=False)`` in
``DefaultLoadPlanner.load_bytes``). ``miles train --resume <folder>`` reads a folder the user
points at, which may come from anywhere, so both go through checks here:

* :class:`SafeFileSystemReader` reads ``.metadata`` with an unpickler that resolves only the
  checkpoint's own metadata classes (DCP's dataclasses and enums), ``torch.Size``, dtypes,
  layouts and paths; any other global (``os.system`` ...) is refused before it is called;
* :class:`SafeLoadPlanner` loads each value with ``torch.load(weights_only=True)`` first, which
  admits tensors and plain data only, and hands DCP the value only if that succeeded.
"""

from __future__ import annotations

import importlib
import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
}


class UnsafeCheckpointError(ValueError):
    """The checkpoint holds something other than tensors, plain data and DCP's own metadata."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == _METADATA_MODULE:
            found = getattr(importlib.import_module(module), name, None)
            # DCP's own metadata dataclasses and enums, not what that module imports (Enum, Any, ...)
            if isinstance(found, type) and found.__module__ == _METADATA_MODULE:
                return found
        elif (module, name) in _ALLOWED:
            return getattr(importlib.import_module(module), name)
        raise UnsafeCheckpointError(f"refusing {module}.{name} in the checkpoint's .metadata: a DCP checkpoint's "
                                    "metadata holds only DCP's own classes; was this folder written by miles?")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError("refusing a persistent id in the checkpoint's .metadata")


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read by :class:`_MetadataUnpickler` (what the
    base class does, minus the unrestricted ``pickle.load``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with open(Path(self.path) / name, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, importlib.import_module(_METADATA_MODULE).Metadata):
            raise UnsafeCheckpointError(f"{Path(self.path) / name} does not hold DCP metadata")
        storage_meta_cls = getattr(importlib.import_module(_METADATA_MODULE), "StorageMeta", None)
        if getattr(metadata, "storage_meta", None) is None and storage_meta_cls is not None:
            metadata.storage_meta = storage_meta_cls()
        if getattr(metadata, "storage_meta", None) is not None and hasattr(self, "load_id"):
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that admits a non-tensor value only if ``weights_only`` can load it."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as exc:
            raise UnsafeCheckpointError(f"refusing the checkpoint value {read_item.dest_index.fqn!r}: it is not plain "
                                        f"data or tensors ({type(exc).__name__}: {str(exc)[:200]})") from None
        # where DefaultLoadPlanner.load_bytes puts the value, without its second, unrestricted load
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
