"""Routed experts from engine payloads to the training batch, without a model: decoding SGLang's
encoding, stitching per-turn pieces by offset through trailing-token trimming, refusing gaps and
overlaps, and batching."""

from __future__ import annotations

import base64
import time

import numpy as np
import pytest
from miles_contracts import CaptureError, ExitReason, MoeLayerMap, Sample, Status, TrainBatch
from miles_contracts.wire.session import TurnCapture, TurnRecord
from miles_r3.capture import RoutedExpertsCapture
from miles_r3.experts import ROUTED_EXPERTS, RoutedExperts, decode_payload
from miles_tito.assembly import assemble, attach_captures

# 4 decoder layers, layers 1 and 3 MoE (8 experts, top-2): SGLang reports all 4 layers per row.
MAP = MoeLayerMap(num_layers=4, moe_layers=(1, 3), num_experts=8, top_k=2, hf_router="model.layers.{layer}.mlp.gate")


def experts_of(tokens: list[int]) -> np.ndarray:
    """A stand-in router: ``[len(tokens), 2, 2]`` ids that depend on the token and all before it
    (like a causal model's routing), so a replaced token changes its row."""
    rows = []
    for i in range(len(tokens)):
        h = hash(tuple(tokens[: i + 1])) % (8 * 7 * 8 * 7)
        a, b = h % 8, (h // 8) % 7
        c, d = (h // 56) % 8, (h // 448) % 7
        rows.append([[a, (a + 1 + b) % 8], [c, (c + 1 + d) % 8]])
    return np.array(rows, dtype=np.int32)


def sglang_payload(moe_rows: np.ndarray) -> str:
    """SGLang's ``meta_info.routed_experts``: int32 over *all* decoder layers, dense layers zero."""
    full = np.zeros((moe_rows.shape[0], MAP.num_layers, MAP.top_k), dtype="<i4")
    full[:, list(MAP.moe_layers)] = moe_rows
    return base64.b64encode(full.tobytes()).decode()


def record(turn: int, input_ids: list[int], output_ids: list[int], start: int, payload: str | None = "auto") -> TurnRecord:
    fed = input_ids + output_ids
    rows = len(fed) - 1 - start
    if payload == "auto":
        payload = sglang_payload(experts_of(fed)[start : len(fed) - 1])
    return TurnRecord(
        turn=turn, message_count=1, input_ids=input_ids, output_ids=output_ids, output_logprobs=[-0.5] * len(output_ids),
        finish_reason="tool_calls" if turn < 2 else "stop", message={"role": "assistant", "content": ""},
        created_at=time.time(), captures={ROUTED_EXPERTS.name: [TurnCapture(start=start, rows=rows, payload=payload)]},
    )


def conversation(trimmed: int) -> list[TurnRecord]:
    """Three turns; the first turn's last ``trimmed`` sampled tokens are replaced by the next prompt.

    Each turn asks from the first position the kept turns have not reported, as the session does:
    ``min(n - 1, n - trimmed)`` of the previous turn's ``n`` ids.
    """
    prompt = [10, 11, 12]
    out0 = [20, 98, 99][: 3 - trimmed] + [98, 99][2 - trimmed :]  # trimmed ids at the end
    in1 = prompt + out0[: 3 - trimmed] + [30, 31]
    out1 = [40, 41]
    in2 = in1 + out1 + [50]
    out2 = [60, 61, 62]
    n0, n1 = len(prompt) + 3, len(in1) + 2
    return [
        record(0, prompt, out0, 0),
        record(1, in1, out1, min(n0 - 1, n0 - trimmed)),
        record(2, in2, out2, min(n1 - 1, n1)),
    ]


def stitched(records: list[TurnRecord], max_trim_tokens: int = 2) -> Sample:
    sample = assemble(records, max_trim_tokens=max_trim_tokens)
    return attach_captures(records, sample, [RoutedExpertsCapture(MAP)])


# ----------------------------------------------------------------------------- decoding


def test_decode_reads_all_decoder_layers_or_moe_layers_only() -> None:
    rows = experts_of([1, 2, 3, 4])
    from_sglang = decode_payload(sglang_payload(rows), 4, MAP)
    moe_only = decode_payload(base64.b64encode(rows.astype("<i4").tobytes()).decode(), 4, MAP)
    np.testing.assert_array_equal(from_sglang, rows)
    np.testing.assert_array_equal(moe_only, rows)
    assert from_sglang.dtype == np.uint8  # 8 experts (+ "no record") fit one byte: 4x below the wire's int32


@pytest.mark.parametrize(("payload", "rows", "message"), [
    ("not base64!", 2, "not valid base64"),
    (base64.b64encode(np.zeros((2, 3, 2), "<i4").tobytes()).decode(), 2, "3 layers per position"),
    (base64.b64encode(np.full((2, 2, 2), 8, "<i4").tobytes()).decode(), 2, r"outside \[0, 8\)"),
    (base64.b64encode(b"\x00" * 6).decode(), 2, "not int32 rows"),
    (None, 2, "base64 string"),
])
def test_decode_refuses_what_it_cannot_read(payload: str | None, rows: int, message: str) -> None:
    with pytest.raises(CaptureError, match=message):
        decode_payload(payload, rows, MAP)


# ----------------------------------------------------------------------------- stitching


@pytest.mark.parametrize("trimmed", [0, 1, 2])
def test_turns_stitch_by_offset_into_the_final_sequence(trimmed: int) -> None:
    records = conversation(trimmed)
    sample = stitched(records)
    assert sample.status is Status.COMPLETED, sample.exit_detail
    assert sample.metadata["tito"]["trimmed"] == [trimmed, 0, 0]
    got = sample.stash[ROUTED_EXPERTS]
    assert got.ids.shape == (len(sample.tokens) - 1, 2, 2)
    # every row is the routing of its position in the *final* sequence: trimmed tokens' rows are gone
    np.testing.assert_array_equal(got.ids, experts_of(sample.tokens)[:-1])
    # each later turn starts where the kept turns' rows end
    n1 = len(records[1].input_ids) + len(records[1].output_ids)
    assert [r.captures[ROUTED_EXPERTS.name][0].start for r in records] == [0, min(5, 6 - trimmed), n1 - 1]


@pytest.mark.parametrize(("shift", "kind"), [(1, "a gap"), (-1, "an overlap")])
def test_a_gap_or_an_overlap_drops_the_sample_with_a_reason(shift: int, kind: str) -> None:
    records = conversation(0)
    bad = records[1].captures[ROUTED_EXPERTS.name][0]
    start = bad.start + shift
    fed = records[1].input_ids + records[1].output_ids
    records[1].captures[ROUTED_EXPERTS.name] = [TurnCapture(
        start=start, rows=len(fed) - 1 - start, payload=sglang_payload(experts_of(fed)[start : len(fed) - 1]))]
    sample = stitched(records)
    assert (sample.status, sample.exit_reason) == (Status.FAILED, ExitReason.MISSING_CAPTURE)
    assert kind in sample.exit_detail and ROUTED_EXPERTS not in sample.stash


def test_a_turn_without_routing_drops_the_sample() -> None:
    records = conversation(1)
    records[2] = record(2, records[2].input_ids, records[2].output_ids, records[2].captures[ROUTED_EXPERTS.name][0].start, None)
    sample = stitched(records)
    assert (sample.status, sample.exit_reason) == (Status.FAILED, ExitReason.MISSING_CAPTURE)
    assert "call 2 returned no payload" in sample.exit_detail


def test_rolled_back_turns_are_not_stitched() -> None:
    records = conversation(0)
    retried = records[1].model_copy(update={"rolled_back": True, "captures": {}})
    sample = stitched([records[0], retried, records[1], records[2]])
    assert sample.status is Status.COMPLETED
    np.testing.assert_array_equal(sample.stash[ROUTED_EXPERTS].ids, experts_of(sample.tokens)[:-1])


# ----------------------------------------------------------------------------- batching


def test_routed_experts_reach_the_batch_aligned_with_tokens() -> None:
    def sample(n: int, with_experts: bool) -> Sample:
        s = Sample(tokens=list(range(1, n + 1)), response_length=2, loss_mask=[1, 1], rollout_logprobs=[-1.0, -1.0],
                   reward=1.0, status=Status.COMPLETED)
        if with_experts:
            s.stash[ROUTED_EXPERTS] = RoutedExperts(experts_of(s.tokens)[:-1].astype(np.uint8), 8)
        return s

    samples = [sample(5, True), sample(3, True), sample(4, False)]
    batch = TrainBatch.from_samples(samples, pad_token_id=0)
    table = batch.extra(ROUTED_EXPERTS)
    assert table is not None and tuple(table.shape) == (3, 5, 2, 2) and str(table.dtype) == "torch.uint8"
    np.testing.assert_array_equal(table[0, :4].numpy(), experts_of(samples[0].tokens)[:-1])
    assert bool((table[0, 4] == 8).all()) and bool((table[1, 2:] == 8).all()) and bool((table[2] == 8).all())
    assert tuple(batch.select([1]).extra(ROUTED_EXPERTS).shape) == (1, 3, 2, 2)  # micro-batches slice it too

    samples[1].stash[ROUTED_EXPERTS] = RoutedExperts(np.zeros((1, 2, 2), np.uint8), 8)  # not len(tokens) - 1 rows
    with pytest.raises(ValueError, match="len\\(tokens\\) - 1"):
        TrainBatch.from_samples(samples, pad_token_id=0)


@pytest.mark.parametrize("trimmed", [0, 1])
def test_a_turn_a_weight_update_split_in_two_calls_stitches_like_one(trimmed: int) -> None:
    """Partial rollout: the second call of a turn asks only for the rows the first did not cover."""
    whole = stitched(conversation(trimmed)).stash[ROUTED_EXPERTS].ids
    records = conversation(trimmed)
    piece = records[1].captures[ROUTED_EXPERTS.name][0]
    fed = records[1].input_ids + records[1].output_ids
    cut = piece.start + 2
    records[1].captures[ROUTED_EXPERTS.name] = [
        TurnCapture(start=piece.start, rows=cut - piece.start, payload=sglang_payload(experts_of(fed)[piece.start : cut])),
        TurnCapture(start=cut, rows=len(fed) - 1 - cut, payload=sglang_payload(experts_of(fed)[cut : len(fed) - 1])),
    ]
    np.testing.assert_array_equal(stitched(records).stash[ROUTED_EXPERTS].ids, whole)
