"""The bucket digest the trainer sends and the engine checks: one definition, on either side of the
wire, for host and GPU buffers."""

from __future__ import annotations

import hashlib

import pytest
import torch
from miles_contracts.wire.mooncake import DIGEST_CHUNK_BYTES, bucket_digest


def test_the_digest_is_the_sha256_of_the_chunks_sha256s_and_sees_every_byte() -> None:
    bucket = torch.randint(0, 256, (2 * DIGEST_CHUNK_BYTES + 3,), dtype=torch.uint8)  # three chunks, hashed apart
    raw = bucket.numpy().tobytes()
    chunks = [raw[i: i + DIGEST_CHUNK_BYTES] for i in range(0, len(raw), DIGEST_CHUNK_BYTES)]
    expected = hashlib.sha256(b"".join(hashlib.sha256(c).digest() for c in chunks)).hexdigest()
    assert bucket_digest(bucket) == expected
    for where in (0, DIGEST_CHUNK_BYTES + 7, bucket.numel() - 1):
        changed = bucket.clone()
        changed[where] ^= 1
        assert bucket_digest(changed) != expected
    assert bucket_digest(bucket[:0]) == hashlib.sha256(b"").hexdigest()


@pytest.mark.gpu
def test_a_gpu_buffer_has_the_digest_of_the_same_bytes_on_the_host() -> None:
    bucket = torch.randint(0, 256, (DIGEST_CHUNK_BYTES + 5,), dtype=torch.uint8)
    assert bucket_digest(bucket.cuda()) == bucket_digest(bucket)
