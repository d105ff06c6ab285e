"""Wire schemas: requests reject what SGLang would not understand; tensors cross processes exactly."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
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
