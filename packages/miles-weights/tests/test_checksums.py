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


def test_tally_skips_a_tied_alias_of_a_tensor_it_passed() -> None:
    embed = torch.randn(5, 3)
    head = embed  # tied: the same tensor under a second name (a state_dict of a tied model)
    view = embed.view(5, 3)  # another Python object over the very same bytes
    part = embed[1:]  # overlapping, but other bytes: not an alias
    tally = TensorTally(iter([("embed", embed), ("lm_head", head), ("head_view", view), ("part", part)]), checksums=True)
    assert [name for name, _ in tally] == ["embed", "part"]
    assert tally.aliases == {"lm_head": "embed", "head_view": "embed"}
    assert (tally.count, tally.nbytes) == (2, 15 * 4 + 12 * 4)
    assert set(tally.checksums) == {"embed", "part"}


def test_tally_does_not_take_reused_memory_for_an_alias() -> None:
    """A producer that frees each tensor before making the next may get the same address back;
    only a tensor still alive can be an alias."""
    def fresh():
        for i in range(4):
            yield f"w{i}", torch.full((64, 64), float(i))

    tally = TensorTally(fresh(), checksums=False)
    assert [name for name, _ in tally] == ["w0", "w1", "w2", "w3"] and not tally.aliases


def test_compare_flags_a_sent_tensor_the_noise_already_matched() -> None:
    """Noise that happens to equal the trainer's bytes (a model drawn with the engine's own
    generator and seed) proves nothing for that tensor: the check must say so, not pass silently."""
    sent = {"embed": "E", "norm": "N", "step": "S"}
    engine = {"embed": "E", "norm": "N", "step": "S"}
    noise = {"embed": "E", "norm": "noise", "step": "S"}  # "step" is an integer buffer: noise leaves it alone
    diff = compare_checksums(sent, engine, noise, not_floating={"step"})
    assert diff.unproven == ["embed"] and not diff.ok
    assert "check_seed" in diff.describe()
    assert compare_checksums(sent, engine, {"embed": "x", "norm": "y", "step": "S"}, not_floating={"step"}).ok
