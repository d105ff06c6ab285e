"""Tensors across a process boundary on one host, for ``/update_weights_from_tensor``.

Two formats, named by ``load_format``:

* ``"flattened_shm"`` (CPU): the trainer packs a bucket of tensors into one flat byte buffer in a
  file under ``/dev/shm`` and sends JSON metadata only (:class:`ShmBucket`): no pickles cross the
  wire, and the engine maps the file read-only and copies each tensor out. The sender deletes the
  file after the engine answered.
* ``"cuda_ipc"`` (GPU): each tensor is flattened into one CUDA buffer per dtype and shared through
  torch's CUDA IPC reductions; the handle is pickled (``torch.multiprocessing`` ForkingPickler,
  the byte format SGLang's payloads use too). The receiver never runs ``pickle.loads`` on them:
  :func:`deserialize_cuda_ipc` is a restricted unpickler that resolves exactly the names torch's
  CUDA reduction writes (``rebuild_cuda_tensor``, the tensor, parameter and storage classes as
  inert markers, ``torch.Size``, dtypes), checks every argument of each rebuild, and refuses
  anything else before it is called (see :mod:`miles_contracts.wire.cuda_ipc`).

A real SGLang server takes neither name: it unpickles every payload (its own risk, behind its
``--api-key``), one per tensor-parallel rank. :func:`serialize_sglang_bucket` writes what it takes
for ``load_format: "flattened_bucket"``: a dict of one flat CUDA byte buffer and one metadata
record per tensor, made only of types SGLang's restricted unpickler allows (``types``, ``torch``,
``multiprocessing``), with the buffer's device named by its UUID as SGLang's own senders do, so
that processes with different ``CUDA_VISIBLE_DEVICES`` open the right GPU.

torch is imported inside functions; importing this module is free.
"""

from __future__ import annotations

import base64
import os
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SHM_FORMAT = "flattened_shm"
CUDA_IPC_FORMAT = "cuda_ipc"
_ALIGN = 64


@dataclass(frozen=True, slots=True)
class TensorMeta:
    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    shape: list[int]
    offset: int  # byte offset in the flat buffer
    nbytes: int


@dataclass(frozen=True, slots=True)
class ShmBucket:
    path: str
    size: int
    tensors: list[TensorMeta]

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "tensors": [asdict(t) for t in self.tensors]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ShmBucket:
        return cls(data["path"], int(data["size"]), [TensorMeta(**t) for t in data["tensors"]])


def _dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


def tensor_layout(tensors: list[tuple[str, torch.Tensor]], align: int = _ALIGN) -> tuple[list[TensorMeta], int]:
    """Where each tensor lives in one flat byte buffer (offsets multiples of ``align``), and its size."""
    metas, offset = [], 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        metas.append(TensorMeta(name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, nbytes))
        offset += (nbytes + align - 1) // align * align
    return metas, offset


_PREFIX = "miles-weights-"


def shm_dir() -> Path:
    return Path(os.environ.get("MILES_SHM_DIR", "/dev/shm"))


def create_shm_file(size: int) -> Path:
    """A new ``size``-byte file for a bucket under :func:`shm_dir`, readable by this user only
    (mode 0600: the weights of a run are not for other local users). Its name carries this
    process's id, so a later run can tell an orphan (:func:`remove_stale_shm_files`)."""
    path = shm_dir() / f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return path


def remove_stale_shm_files() -> list[Path]:
    """Delete this user's bucket files whose creating process is gone (a driver killed with
    SIGKILL cannot clean up after itself); returns what was removed. Files of live processes stay."""
    removed: list[Path] = []
    folder = shm_dir()
    try:
        candidates = list(folder.glob(_PREFIX + "*"))
    except OSError:
        return removed
    for path in candidates:
        pid = path.name[len(_PREFIX):].split("-", 1)[0]
        try:
            if not pid.isdigit() or path.stat().st_uid != os.getuid() or _alive(int(pid)):
                continue
            path.unlink()
        except OSError:  # gone meanwhile, or not ours to remove
            continue
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process holds this pid
        return True
    return True


def write_shm_bucket(tensors: Iterable[tuple[str, torch.Tensor]]) -> ShmBucket:
    """Pack ``tensors`` (any device) into a new shared-memory file; the caller deletes it."""
    import torch

    items = [(n, t.detach()) for n, t in tensors]
    metas, size = tensor_layout(items)
    path = create_shm_file(max(size, 1))
    flat = torch.from_file(str(path), shared=True, size=max(size, 1), dtype=torch.uint8)
    for meta, (_, t) in zip(metas, items, strict=True):
        view = flat[meta.offset : meta.offset + meta.nbytes]
        view.copy_(t.contiguous().reshape(-1).view(torch.uint8).cpu())
    return ShmBucket(str(path), size, metas)


def read_shm_bucket(bucket: ShmBucket) -> list[tuple[str, torch.Tensor]]:
    """Views into the bucket's file (valid while the returned tensors live; copy them out)."""
    import torch

    path = Path(bucket.path)
    if path.parent != shm_dir() or not path.name.startswith(_PREFIX) or path.is_symlink():
        raise ValueError(f"refusing shared-memory path {bucket.path!r}: not a Miles weight bucket under {shm_dir()}")
    flat = torch.from_file(str(path), shared=False, size=max(bucket.size, 1), dtype=torch.uint8)
    out = []
    for meta in bucket.tensors:
        raw = flat[meta.offset : meta.offset + meta.nbytes]
        out.append((meta.name, raw.view(_dtype(meta.dtype)).reshape(meta.shape)))
    return out


def serialize_cuda_ipc(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """base64 of a ForkingPickler pickle of ``[(name, cuda_tensor)]`` (CUDA IPC handles)."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's CUDA IPC reductions with ForkingPickler)

    buffer = io.BytesIO()
    ForkingPickler(buffer).dump([(n, t.detach()) for n, t in tensors])
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def deserialize_cuda_ipc(payload: str) -> list[tuple[str, torch.Tensor]]:
    """The ``[(name, cuda_tensor)]`` of a :func:`serialize_cuda_ipc` payload, through the restricted
    loader of :mod:`miles_contracts.wire.cuda_ipc` (raises ``UnsafePayloadError`` for anything else)."""
    from miles_contracts.wire.cuda_ipc import load_named_tensors

    return load_named_tensors(base64.b64decode(payload, validate=True))


SGLANG_BUCKET_FORMAT = "flattened_bucket"


def serialize_sglang_bucket(flat: torch.Tensor, metas: Iterable[TensorMeta]) -> str:
    """SGLang's ``update_weights_from_tensor`` payload for ``load_format: "flattened_bucket"``.

    :param flat: ``[nbytes]`` uint8 buffer holding every tensor at ``meta.offset`` (CUDA for a real
        SGLang server; a CPU buffer pickles too, through a file descriptor, for tests).
    :param metas: where each tensor lives in ``flat``; offsets must suit each dtype's alignment.
    """
    import io
    from types import SimpleNamespace

    import torch

    records = [SimpleNamespace(name=m.name, shape=torch.Size(m.shape), dtype=_dtype(m.dtype), start_idx=m.offset,
                               end_idx=m.offset + m.nbytes, numel=m.nbytes) for m in metas]
    buffer = io.BytesIO()
    _uuid_pickler(buffer).dump({"flattened_tensor": flat, "metadata": records})
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _uuid_pickler(buffer: Any) -> Any:
    """A ForkingPickler whose CUDA tensors name their device by UUID (argument 6 of torch's
    ``rebuild_cuda_tensor``; SGLang's receiving side maps it back to a local index)."""
    import copyreg
    from collections import ChainMap
    from multiprocessing.reduction import ForkingPickler

    import torch
    from torch.multiprocessing import reductions

    def reduce(tensor: torch.Tensor) -> Any:
        rebuild, args = reductions.reduce_tensor(tensor)  # type: ignore[no-untyped-call]
        if rebuild is reductions.rebuild_cuda_tensor:
            args = (*args[:6], str(torch.cuda.get_device_properties(args[6]).uuid), *args[7:])
        return rebuild, args

    pickler = ForkingPickler(buffer)
    pickler.dispatch_table = ChainMap({torch.Tensor: reduce}, ForkingPickler._extra_reducers, copyreg.dispatch_table)  # type: ignore[assignment,attr-defined]
    return pickler
