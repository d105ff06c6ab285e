"""Sample invariants and the typed stash."""

from __future__ import annotations

import pytest
from miles_contracts import ExitReason, Sample, SampleError, StashKey, Status

EXPERTS: StashKey[list[int]] = StashKey("test.experts")


def test_validate_names_every_broken_length() -> None:
    s = Sample(tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1], rollout_logprobs=[-0.1, -0.2, -0.3])
    with pytest.raises(SampleError) as info:
        s.validate()
    assert "loss_mask has 1 entries, response_length is 2" in str(info.value)
    assert "rollout_logprobs has 3 entries" in str(info.value)


def test_response_view_and_trainable() -> None:
    s = Sample(tokens=[5, 6, 7], response_length=1, loss_mask=[1], reward=1.0).finish(Status.COMPLETED, ExitReason.STOP)
    assert s.prompt_length == 2 and s.response_tokens == [7]
    assert s.trainable
    assert not Sample(tokens=[5], response_length=1, loss_mask=[1], reward=None, status=Status.COMPLETED).trainable


def test_stash_is_typed_per_key_and_copied_by_value() -> None:
    s = Sample()
    s.stash[EXPERTS] = [1, 2]
    assert s.stash[EXPERTS] == [1, 2] and EXPERTS in s.stash
    copy = s.stash.copy()
    del s.stash[EXPERTS]
    assert copy.get(EXPERTS) == [1, 2] and s.stash.get(EXPERTS, "none") == "none"
    with pytest.raises(KeyError, match="test.experts"):
        _ = s.stash[EXPERTS]
    assert Sample().to_dict()["stash"] == {}
