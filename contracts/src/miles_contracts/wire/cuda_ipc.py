"""Reading a ``cuda_ipc`` weight payload without running what it asks to run.

SGLang's ``/update_weights_from_tensor`` payload is a ``ForkingPickler`` pickle of ``[(name,
tensor)]``, in which torch's CUDA reduction turns each tensor into a call
``rebuild_cuda_tensor(Tensor, Size, stride, offset, TypedStorage, dtype, device, handle, ...)``
(``torch/multiprocessing/reductions.py``: ``reduce_tensor`` / ``rebuild_cuda_tensor``). Miles keeps
that format, so one trainer speaks to SGLang and to the embedded engine alike, but a pickle may
call any importable function, so the embedded engine reads it with :class:`_HandleUnpickler`:

* ``find_class`` resolves only ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` (to
  :func:`_rebuild`, which checks each argument first), ``torch.Size`` (to a checked constructor;
  both behind an immutable wrapper),
  torch dtypes, and the tensor / parameter / storage classes -- the last as inert markers that
  cannot be called, so a payload cannot construct a tensor of its choice either. Any other name
  (``os.system``, ``builtins.eval``, ``torch.load`` ...) raises :class:`UnsafePayloadError` before
  anything is called; so does a persistent id;
* :func:`_rebuild` accepts only the argument types torch writes (ints, bytes, bools, a device
  index that exists) and hands the real classes to torch's ``rebuild_cuda_tensor``;
* the result must be a list of ``(str, tensor)`` pairs.

What remains reachable is what the format is for: opening CUDA IPC handles. Only callers with
the run's token reach the route at all.
"""

from __future__ import annotations

import io
import pickle
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_REBUILD = ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")
_MARKED_CLASSES = {
    ("torch", "Tensor"): "tensor", ("torch.nn.parameter", "Parameter"): "parameter",
    ("torch.storage", "TypedStorage"): "storage", ("torch.storage", "UntypedStorage"): "storage",
    ("torch", "UntypedStorage"): "storage", ("torch", "TypedStorage"): "storage",
}
_MAX_DIMS = 64


class UnsafePayloadError(ValueError):
    """The payload is not a list of CUDA tensor handles as torch's reductions write them."""


class _Marker:
    """Stands for a class the payload names; resolved by :func:`_rebuild`, never callable, and
    immutable (a pickle's BUILD opcode cannot retarget it)."""

    __slots__ = ("kind", "module", "name")
    kind: str
    module: str
    name: str

    def __init__(self, kind: str, module: str, name: str) -> None:
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "module", module)
        object.__setattr__(self, "name", name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise UnsafePayloadError("a cuda_ipc payload may not modify a class marker")

    def resolve(self) -> Any:
        import importlib

        return getattr(importlib.import_module(self.module), self.name)


_MARKERS = {key: _Marker(kind, *key) for key, kind in _MARKED_CLASSES.items()}


def load_named_tensors(data: bytes) -> list[tuple[str, torch.Tensor]]:
    """``[(name, cuda_tensor)]`` from raw (not base64) payload bytes; see the module docstring."""
    import torch

    try:
        loaded = _HandleUnpickler(io.BytesIO(data)).load()
    except UnsafePayloadError:
        raise
    except Exception as exc:  # a truncated or malformed pickle
        raise UnsafePayloadError(f"cannot read the cuda_ipc payload: {type(exc).__name__}: {exc}") from None
    if not isinstance(loaded, list) or not all(
            isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)
            for item in loaded):
        raise UnsafePayloadError("a cuda_ipc payload must hold a list of (name, tensor) pairs")
    return loaded


class _HandleUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) == _REBUILD:
            return _REBUILD_CALL
        if (module, name) in _MARKERS:
            return _MARKERS[(module, name)]
        if module == "torch" and name == "Size":
            return _SIZE_CALL
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafePayloadError(f"refusing {module}.{name} in a cuda_ipc payload: it may only rebuild CUDA tensors "
                                 "(torch.multiprocessing.reductions.rebuild_cuda_tensor)")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePayloadError("refusing a persistent id in a cuda_ipc payload")


def _size(dims: Any = ()) -> torch.Size:
    import torch

    if not isinstance(dims, tuple | list) or len(dims) > _MAX_DIMS or not all(_is_count(d) for d in dims):
        raise UnsafePayloadError(f"a tensor size must be a short list of non-negative ints, got {dims!r:.100}")
    return torch.Size(dims)


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _rebuild(tensor_cls: Any, size: Any, stride: Any, offset: Any, storage_cls: Any, dtype: Any, device: Any,
             handle: Any, storage_bytes: Any, storage_offset: Any, requires_grad: Any, ref_counter_handle: Any,
             ref_counter_offset: Any, event_handle: Any, event_sync_required: Any) -> torch.Tensor:
    """torch's ``rebuild_cuda_tensor`` after checking that every argument is what torch writes."""
    import torch
    from torch.multiprocessing import reductions

    problems = []
    if not (isinstance(tensor_cls, _Marker) and tensor_cls.kind in ("tensor", "parameter")):
        problems.append("the tensor class is not torch.Tensor or Parameter")
    if not (isinstance(storage_cls, _Marker) and storage_cls.kind == "storage"):
        problems.append("the storage class is not a torch storage")
    if not isinstance(size, torch.Size):
        problems.append("the size is not a torch.Size")
    if not (isinstance(stride, tuple) and len(stride) == len(size or ()) and all(_is_count(s) for s in stride)):
        problems.append("the stride is not one non-negative int per dimension")
    if not isinstance(dtype, torch.dtype):
        problems.append("the dtype is not a torch dtype")
    if not all(_is_count(v) for v in (offset, storage_bytes, storage_offset, ref_counter_offset)):
        problems.append("offsets and sizes must be non-negative ints")
    if not all(v is None or type(v) is bytes for v in (handle, ref_counter_handle, event_handle)):
        problems.append("IPC handles must be bytes")
    if type(requires_grad) is not bool or type(event_sync_required) is not bool:
        problems.append("requires_grad and event_sync_required must be bools")
    if not _is_count(device):
        problems.append("the device must be a CUDA device index")
    if problems:
        raise UnsafePayloadError("refusing a cuda_ipc tensor: " + "; ".join(problems))
    if not torch.cuda.is_available() or device >= torch.cuda.device_count():
        raise UnsafePayloadError(f"the cuda_ipc payload names CUDA device {device}, which this process does not have")
    rebuilt: torch.Tensor = reductions.rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
        tensor_cls.resolve(), size, stride, offset, storage_cls.resolve(), dtype, device, handle, storage_bytes,
        storage_offset, requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required,
    )
    return rebuilt


class _Call:
    """A checked function handed to the payload: callable, but immutable like :class:`_Marker` (a
    pickle's BUILD opcode applied to a plain function could rewrite its ``__defaults__``)."""

    __slots__ = ("_fn",)
    _fn: Any

    def __init__(self, fn: Any) -> None:
        object.__setattr__(self, "_fn", fn)

    def __setattr__(self, name: str, value: Any) -> None:
        raise UnsafePayloadError("a cuda_ipc payload may not modify the functions it calls")

    def __call__(self, *args: Any) -> Any:
        return self._fn(*args)


_REBUILD_CALL = _Call(_rebuild)
_SIZE_CALL = _Call(_size)
