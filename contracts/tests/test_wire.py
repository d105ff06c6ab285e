"""Wire schemas: requests reject what SGLang would not understand; tensors cross processes exactly."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from miles_contracts.wire.distributed import bucket_nbytes, flatten_bucket, unflatten_bucket
from miles_contracts.wire.engine import GenerateRequest, GenerateResponse
from miles_contracts.wire.tensors import ShmBucket, read_shm_bucket, write_shm_bucket
from pydantic import ValidationError


def test_generate_request_needs_exactly_one_input_and_rejects_unknown_fields() -> None:
    GenerateRequest(input_ids=[1, 2])
    with pytest.raises(ValidationError, match="exactly one of 'text' and 'input_ids'"):
        GenerateRequest()
    with pytest.raises(ValidationError, match="extra"):
        GenerateRequest.model_validate({"input_ids": [1], "sampling_params": {"max_new_token": 3}})
    with pytest.raises(ValidationError, match="top_k"):
        GenerateRequest.model_validate({"text": "x", "sampling_params": {"top_k": 0}})


def test_generate_response_tolerates_new_sglang_keys_and_extracts_logprobs() -> None:
    response = GenerateResponse.model_validate({
        "text": "hi", "output_ids": [5, 6], "new_top_level_key": 1,
        "meta_info": {"id": "r", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3,
                      "completion_tokens": 2, "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]],
                      "spec_verify_ct": 0},
    })
    assert response.logprobs() == [-0.1, -0.2]


def test_a_shared_memory_bucket_is_read_bit_exactly_by_another_process() -> None:
    tensors = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64)), ("c", torch.randn(4, dtype=torch.bfloat16))]
    bucket = write_shm_bucket(tensors)
    try:
        script = (
            "import json, sys, torch\n"
            "from miles_contracts.wire.tensors import ShmBucket, read_shm_bucket\n"
            "out = read_shm_bucket(ShmBucket.from_json(json.loads(sys.stdin.read())))\n"
            "print(json.dumps({n: t.view(torch.uint8).reshape(-1).tolist() for n, t in out}))\n"
        )
        import json

        result = subprocess.run([sys.executable, "-c", script], input=json.dumps(bucket.to_json()),
                                capture_output=True, text=True, check=True)
        raw = json.loads(result.stdout)
        for name, tensor in tensors:
            assert raw[name] == tensor.contiguous().view(torch.uint8).reshape(-1).tolist(), name
    finally:
        os.unlink(bucket.path)


def test_reading_refuses_paths_that_are_not_weight_buckets() -> None:
    with pytest.raises(ValueError, match="refusing shared-memory path"):
        read_shm_bucket(ShmBucket("/etc/passwd", 10, []))


def test_a_flattened_bucket_is_raw_bytes_back_to_back_and_unflattens_bit_exactly() -> None:
    """SGLang's flattened_bucket layout: no padding, so a float32 may land on an offset that is not a
    multiple of 4 (after three bfloat16s); it then comes back as an aligned copy instead of a view."""
    gen = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, generator=gen).to(torch.bfloat16),       # 6 bytes: the next offset is 6
        torch.randn(2, 5, generator=gen),                       # float32 at offset 6
        torch.arange(7, dtype=torch.int64).reshape(7, 1),       # int64 at offset 46
        torch.randn(4, 4, generator=gen).t(),                   # not contiguous
    ]
    names = [f"t{i}" for i in range(len(tensors))]
    flat = flatten_bucket(tensors)
    assert flat.dtype == torch.uint8 and flat.numel() == 6 + 40 + 56 + 64
    assert flat.numel() == bucket_nbytes([t.dtype for t in tensors], [tuple(t.shape) for t in tensors])
    assert bytes(flat[:6].tolist()) == bytes(tensors[0].view(torch.uint8).tolist())  # bytes as they are in memory
    back = unflatten_bucket(flat, names, [t.dtype for t in tensors], [tuple(t.shape) for t in tensors])
    assert [n for n, _ in back] == names
    for (_, got), want in zip(back, tensors, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert back[0][1].data_ptr() == flat.data_ptr()  # aligned: a view, no copy
    assert back[1][1].data_ptr() % 4 == 0 and back[1][1].data_ptr() != flat.data_ptr() + 6  # misaligned: a copy
    with pytest.raises(ValueError, match="holds 166 bytes, its tensors need 168"):
        unflatten_bucket(flat, ["a", "b"], [torch.float32, torch.float32], [(40,), (2,)])
