"""The ``flattened_bucket`` payload Miles sends to a real SGLang server's ``/update_weights_from_tensor``.

SGLang cannot run here; what it does with the payload is small and is restated below: it base64-
decodes and unpickles it with a restricted unpickler that refuses every class outside a list of
module prefixes (SGLang 0.5.13 ``SafeUnpickler``; a Miles class would be refused, and SGLang's
process cannot import Miles anyway), then slices each tensor out of the flat buffer with
``flat[start_idx:end_idx].view(dtype).reshape(shape)``. A CPU buffer stands in for the CUDA one
(it pickles through a file descriptor instead of a CUDA IPC handle; the records are the same).
"""

from __future__ import annotations

import base64
import io
import pickle

import pytest

torch = pytest.importorskip("torch")

from miles_contracts.wire.tensors import serialize_sglang_bucket, tensor_layout  # noqa: E402

SGLANG_ALLOWED_PREFIXES = ("builtins.", "collections.", "copyreg.", "functools.", "itertools.", "operator.",
                           "types.", "weakref.", "torch.", "multiprocessing.resource_sharer.",
                           "multiprocessing.reduction.", "pickletools.")


class RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if not any(f"{module}.".startswith(prefix) for prefix in SGLANG_ALLOWED_PREFIXES):
            raise pickle.UnpicklingError(f"SGLang would refuse {module}.{name}")
        return super().find_class(module, name)


def test_sglang_can_unpickle_and_slice_every_tensor_bit_exactly():
    import torch.multiprocessing  # noqa: F401  (torch's reductions, as in SGLang's process)

    tensors = [("model.embed_tokens.weight", torch.randn(7, 5, dtype=torch.bfloat16)),
               ("model.norm.weight", torch.randn(5)),
               ("model.layers.0.mlp.down_proj.weight", torch.randn(3, 3, dtype=torch.float16))]
    metas, size = tensor_layout(tensors, 256)
    flat = torch.zeros(size, dtype=torch.uint8)
    for meta, (_, tensor) in zip(metas, tensors, strict=True):
        flat[meta.offset:meta.offset + meta.nbytes].copy_(tensor.reshape(-1).view(torch.uint8))

    bucket = RestrictedUnpickler(io.BytesIO(base64.b64decode(serialize_sglang_bucket(flat, metas)))).load()

    received = bucket["flattened_tensor"]
    rebuilt = [(m.name, received[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in bucket["metadata"]]
    assert [name for name, _ in rebuilt] == [name for name, _ in tensors]
    for (_, got), (_, sent) in zip(rebuilt, tensors, strict=True):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
    assert all(m.numel == m.end_idx - m.start_idx for m in bucket["metadata"])
