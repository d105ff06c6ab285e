"""Engine capture specs are checked against the generate request, and pieces must tile a sample."""

from __future__ import annotations

import pytest
from miles_contracts import CapturedPiece, CaptureError, CaptureSpec, check_tiling
from pydantic import ValidationError


def piece(start: int, stop: int, rows: int | None = None, payload: object = "x") -> CapturedPiece:
    return CapturedPiece(start=start, rows=stop - start if rows is None else rows, stop=stop, payload=payload)


def test_a_spec_names_generate_request_fields_only() -> None:
    spec = CaptureSpec(name="p.data", request_fields={"return_routed_experts": True},
                       start_field="routed_experts_start_len", meta_info_key="routed_experts")
    assert CaptureSpec.model_validate(spec.model_dump()) == spec  # travels as JSON to session servers
    with pytest.raises(ValidationError, match="not generate-request fields"):
        CaptureSpec(name="p", request_fields={"return_everything": True}, meta_info_key="k")
    with pytest.raises(ValidationError, match="generators own"):
        CaptureSpec(name="p", request_fields={"input_ids": [1]}, meta_info_key="k")
    with pytest.raises(ValidationError, match="generators own"):
        CaptureSpec(name="p", start_field="logprob_start_len", meta_info_key="k")
    with pytest.raises(ValidationError):
        CaptureSpec(name="p", request_fields={"return_routed_experts": "sometimes"}, meta_info_key="k")


def test_pieces_must_tile_the_positions_exactly_once() -> None:
    check_tiling([piece(0, 5), piece(5, 8, rows=4), piece(8, 12)], 12)  # a piece may end before its payload
    cases = [
        ([], "no engine call"),
        ([piece(0, 5), piece(6, 12)], "a gap at call 1"),
        ([piece(0, 5), piece(4, 12)], "an overlap at call 1"),
        ([piece(0, 5), piece(5, 11)], r"cover positions \[0, 11\)"),
        ([piece(0, 5, payload=None), piece(5, 12)], "call 0 returned no payload"),
        ([piece(0, 6, rows=5), piece(6, 12)], r"payload covers \[0, 5\)"),
    ]
    for pieces, message in cases:
        with pytest.raises(CaptureError, match=message):
            check_tiling(pieces, 12)
