"""Trajectory assembly: property tests of its invariants, plus the outcomes it reports."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from miles_contracts import ExitReason, Sample, Status
from miles_contracts.wire.session import TurnRecord
from miles_tito.assembly import AssemblyError, assemble, merge_turns, turn_samples

ids = st.integers(min_value=10, max_value=60)  # a small alphabet so coincidental matches happen too


def record(turn: int, input_ids: list[int], output_ids: list[int], logprobs: list[float], **extra: object) -> TurnRecord:
    fields = dict(turn=turn, message_count=1, input_ids=input_ids, output_ids=output_ids, output_logprobs=logprobs,
                  finish_reason="stop", weight_version=turn + 1, message={"role": "assistant", "content": ""}, created_at=time.time())
    fields.update(extra)
    return TurnRecord(**fields)


@st.composite
def conversations(draw: st.DrawFn) -> tuple[list[TurnRecord], int, list[int]]:
    """Records of a conversation whose turns chain, each non-last turn losing up to max_trim tail ids."""
    max_trim = draw(st.integers(0, 2))
    turns = draw(st.integers(1, 6))
    prompt = draw(st.lists(ids, min_size=1, max_size=12))
    records, trims = [], []
    for turn in range(turns):
        output = draw(st.lists(ids, min_size=1, max_size=8))
        logprobs = draw(st.lists(st.floats(-8.0, -0.01), min_size=len(output), max_size=len(output)))
        records.append(record(turn, prompt, output, logprobs))
        if turn < turns - 1:
            trim = draw(st.integers(0, min(max_trim, len(output))))
            observation = draw(st.lists(ids, min_size=0, max_size=8))
            prompt = prompt + output[: len(output) - trim] + observation
            trims.append(trim)
    return records, max_trim, trims


@settings(max_examples=300, deadline=None)
@given(conversations())
def test_merged_trajectory_invariants(case: tuple[list[TurnRecord], int, list[int]]) -> None:
    records, max_trim, trims = case
    sample = assemble(records, max_trim_tokens=max_trim)
    sample.validate()  # loss_mask and rollout_logprobs have response_length entries, mask is 0/1

    final = records[-1].input_ids + records[-1].output_ids
    assert sample.tokens == final
    assert sample.prompt_length == len(records[0].input_ids)
    assert sample.weight_versions == [r.weight_version for r in records]
    for r in records:  # the prefix chain: every turn saw a prefix of the conversation
        assert final[: len(r.input_ids)] == r.input_ids

    sampled = 0
    for offset, (mask, logprob) in enumerate(zip(sample.loss_mask, sample.rollout_logprobs, strict=True)):
        position = sample.prompt_length + offset
        if mask == 0:
            assert logprob == 0.0
            continue
        sampled += 1
        # A trained token is exactly what some turn sampled at that position, with that log-prob.
        owner = [r for r in records if len(r.input_ids) <= position < len(r.input_ids) + len(r.output_ids)]
        assert any(r.output_ids[position - len(r.input_ids)] == final[position]
                   and r.output_logprobs[position - len(r.input_ids)] == logprob for r in owner)
    total = sum(len(r.output_ids) for r in records)
    assert total - sum(trims) <= sampled <= total


@settings(max_examples=100, deadline=None)
@given(conversations(), st.integers(0, 2))
def test_turn_samples_are_one_engine_call_each(case: tuple[list[TurnRecord], int, list[int]], rolled: int) -> None:
    records = case[0]
    for r in records[: min(rolled, len(records) - 1)]:
        r.rolled_back = True
    samples = turn_samples(records)
    active = [r for r in records if not r.rolled_back]
    assert len(samples) == len(active)
    for s, r in zip(samples, active, strict=True):
        assert s.tokens == r.input_ids + r.output_ids
        assert s.loss_mask == [1] * len(r.output_ids) and s.rollout_logprobs == r.output_logprobs
        assert s.weight_versions == [r.weight_version]


def test_losing_more_than_the_family_allows_is_an_error() -> None:
    first = record(0, [1, 2], [30, 31, 32], [-1.0] * 3)
    second = record(1, [1, 2, 30, 40, 41], [50], [-1.0])  # 31, 32 replaced: 2 trimmed tokens
    assert assemble([first, second], max_trim_tokens=2).loss_mask == [1, 0, 0, 1]
    with pytest.raises(AssemblyError, match="turn 0: 2 of its sampled tokens"):
        assemble([first, second], max_trim_tokens=1)


def test_a_turn_that_does_not_chain_is_an_error() -> None:
    first = record(0, [1, 2], [30], [-1.0])
    second = record(1, [1, 9, 30, 40], [50], [-1.0])
    with pytest.raises(AssemblyError, match="turn 0: its prompt is not a prefix of the conversation: token 1 is 2 there but 9"):
        assemble([first, second], max_trim_tokens=0)
    with pytest.raises(AssemblyError, match="no generated turn"):
        assemble([], max_trim_tokens=0)


def test_status_comes_from_the_last_turn_and_format_errors_are_reported() -> None:
    tool_turn = record(0, [1], [30], [-1.0], finish_reason="tool_calls", format_error=None)
    bad_turn = record(1, [1, 30, 4], [31], [-1.0], format_error="tool call 1 is not JSON")
    into = Sample(prompt="p", index=7, metadata={"keep": True})
    sample = assemble([tool_turn, bad_turn], max_trim_tokens=0, into=into)
    assert sample is into and sample.index == 7 and sample.metadata["keep"]
    assert (sample.status, sample.exit_reason) == (Status.COMPLETED, ExitReason.FORMAT_ERROR)
    assert "not JSON" in (sample.exit_detail or "")
    truncated = assemble([tool_turn, record(1, [1, 30, 4], [31], [-1.0], finish_reason="length")], max_trim_tokens=0)
    assert (truncated.status, truncated.exit_reason) == (Status.TRUNCATED, ExitReason.LENGTH)
    assert truncated.metadata["tito"]["turn_spans"] == [[0, 1], [2, 3]]


def test_a_trimmed_tail_is_not_credited_when_the_next_turn_samples_the_same_tokens() -> None:
    # Turn 0 sampled [30, 31], both replaced by the next turn's rendering (trimmed); turn 1 then
    # happened to sample [30, 31] again. Only turn 1 owns those positions.
    records = [record(0, [10], [30, 31], [-1.0, -2.0]), record(1, [10], [30, 31, 32], [-3.0, -4.0, -5.0])]
    sample = assemble(records, max_trim_tokens=2)
    assert sample.tokens == [10, 30, 31, 32]
    assert sample.loss_mask == [1, 1, 1]
    assert sample.rollout_logprobs == [-3.0, -4.0, -5.0]


@settings(max_examples=300, deadline=None)
@given(conversations(), st.data())
def test_turns_that_carry_only_a_call_version_or_none_still_make_a_valid_version_list(
        case: tuple[list[TurnRecord], int, list[int]], data: st.DataObject) -> None:
    """Generators fill ``token_versions`` or only ``weight_versions`` (or neither: an engine that
    reports no version). Each merged token keeps its turn's version when the turn says what it is
    (per token, or one call version); when a turn cannot say, the trajectory records none rather
    than a list misaligned with the response (``Sample.validate`` refuses those)."""
    records, max_trim, _ = case
    turns = turn_samples(records)
    kinds = data.draw(st.lists(st.sampled_from(["per_token", "call", "none"]), min_size=len(turns), max_size=len(turns)))
    for turn, kind in zip(turns, kinds, strict=True):
        if kind != "per_token":
            turn.token_versions = []
        if kind == "none":
            turn.weight_versions = []
    sample = merge_turns(turns, max_trim_tokens=max_trim)
    sample.validate()
    if "none" in kinds:
        assert sample.token_versions == []
        return
    assert len(sample.token_versions) == sample.response_length
    for offset, (mask, version) in enumerate(zip(sample.loss_mask, sample.token_versions, strict=True)):
        if not mask:
            assert version == -1
            continue
        position = sample.prompt_length + offset
        owner = next(r for r in reversed(records) if len(r.input_ids) <= position < len(r.input_ids) + len(r.output_ids))
        assert version == owner.weight_version
