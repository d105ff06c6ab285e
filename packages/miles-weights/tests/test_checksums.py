"""Checksums are SHA-256 of raw bytes, whatever the dtype, layout or device; the tally counts one pass."""

from __future__ import annotations

import hashlib

import pytest
import torch
from miles_weights.checksums import TensorTally, compare_checksums, tensor_checksum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_checksum_is_sha256_of_the_raw_bytes(dtype: torch.dtype) -> None:
    tensor = (torch.arange(24) % 5).reshape(2, 3, 4).to(dtype)
    expected = hashlib.sha256(tensor.view(torch.uint8).numpy().tobytes()).hexdigest()
    assert tensor_checksum(tensor) == expected


def test_checksum_ignores_layout_but_not_one_bit() -> None:
    tensor = torch.randn(8, 6)
    assert tensor_checksum(tensor.t()) == tensor_checksum(tensor.t().contiguous())
    flipped = tensor.clone()
    flipped.view(torch.int32)[3, 2] ^= 1  # the lowest mantissa bit of one element
    assert tensor_checksum(flipped) != tensor_checksum(tensor)


def test_tally_counts_and_hashes_in_one_pass() -> None:
    tensors = [("a", torch.zeros(3)), ("b", torch.ones(2, 2, dtype=torch.bfloat16))]
    tally = TensorTally(iter(tensors), checksums=True)
    assert list(tally) == tensors
    assert (tally.count, tally.nbytes) == (2, 3 * 4 + 4 * 2)
    assert tally.checksums == {name: tensor_checksum(t) for name, t in tensors}


def test_tally_rejects_a_name_sent_twice() -> None:
    with pytest.raises(ValueError, match="'a' is pushed twice"):
        list(TensorTally([("a", torch.zeros(1)), ("a", torch.ones(1))], checksums=False))


def test_compare_names_what_differs_is_missing_or_still_noise() -> None:
    sent = {"w1": "x", "w2": "y", "w3": "z"}
    engine = {"w1": "x", "w2": "other", "tied": "restored", "skipped": "noise-of-skipped"}
    noise = {"w1": "n1", "w2": "n2", "tied": "noise-of-tied", "skipped": "noise-of-skipped"}
    diff = compare_checksums(sent, engine, noise)
    assert (diff.differ, diff.missing, diff.still_noise) == (["w2"], ["w3"], ["skipped"])
    assert not diff.ok
    assert "1 tensor(s) differ from the trainer's: w2" in diff.describe()
    assert compare_checksums({"w1": "x"}, {"w1": "x", "other": "?"}).ok  # without noise, unsent names are not judged
