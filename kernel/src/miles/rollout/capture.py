"""Both ends of engine captures, for generators: ask engines for them, keep what came back.

A generator calls :func:`capture_request` on each generate request, :func:`response_pieces` on
each answer and, once the sample's tokens are final, :func:`store_captures` with the pieces clipped
to what survived into the sample. What the data means is the capturing plugin's business (see
:mod:`miles_contracts.capture`); nothing here names one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from miles_contracts import (
    CapturedPiece,
    CaptureError,
    CaptureSpec,
    EngineCapture,
    ExitReason,
    Sample,
    Status,
    check_tiling,
)
from miles_contracts.wire.engine import GenerateRequest, MetaInfo


def capture_request(request: GenerateRequest, specs: Sequence[CaptureSpec], *, start: int = 0) -> GenerateRequest:
    """``request`` with every capture's request fields; the ``start_field`` of each gets ``start``,
    the first position whose data the caller does not hold yet (left at its default for 0)."""
    if not specs:
        return request
    update: dict[str, Any] = {}
    for spec in specs:
        update.update(spec.request_fields)
        if spec.start_field and start:
            update[spec.start_field] = start
    return request.model_copy(update=update)


def response_pieces(meta_info: MetaInfo, specs: Sequence[CaptureSpec], *, start: int = 0) -> dict[str, CapturedPiece]:
    """Each capture's piece of one answer: its payload covers positions ``[start, prompt_tokens +
    completion_tokens - 1)`` (the last sampled token was never fed to the model)."""
    rows = max(meta_info.prompt_tokens + meta_info.completion_tokens - 1 - start, 0)
    return {spec.name: CapturedPiece(start=start, rows=rows, stop=start + rows, payload=meta_info_entry(meta_info, spec.meta_info_key))
            for spec in specs}


def meta_info_entry(meta_info: MetaInfo, key: str) -> Any:
    """``meta_info[key]``, whether the schema names the key or the engine added it."""
    if key in MetaInfo.model_fields:
        return getattr(meta_info, key)
    return (meta_info.model_extra or {}).get(key)


def wants_captures(sample: Sample) -> bool:
    """Captures matter for samples that can be trained on: a response that completed or was cut."""
    return sample.status in (Status.COMPLETED, Status.TRUNCATED) and sample.response_length > 0


def store_captures(sample: Sample, captures: Sequence[EngineCapture], pieces: Mapping[str, Sequence[CapturedPiece]]) -> Sample:
    """Stitch each capture's pieces over ``[0, len(sample.tokens) - 1)`` into the sample's stash.

    A sample that could be trained on but lacks a capture's data (no payload, a gap, an overlap, an
    unreadable payload) is marked FAILED with exit reason ``missing_capture``: it is dropped and
    counted rather than trained without the data. Other samples are left as they are.
    """
    if not captures or not wants_captures(sample):
        return sample
    positions = len(sample.tokens) - 1
    for capture in captures:
        name = capture.spec.name
        mine = pieces.get(name, ())
        try:
            check_tiling(mine, positions, name=name)
            sample.stash[capture.key] = capture.stitch(mine, positions)
        except CaptureError as exc:
            return sample.finish(Status.FAILED, ExitReason.MISSING_CAPTURE, str(exc))
    return sample
