"""Engine captures: per-position data a plugin asks every engine call for, kept on the sample.

Some plugins need more from the engine than tokens and log-probs: routing replay needs the experts
each MoE layer chose for every position. A plugin describes such data once, as a
:class:`CaptureSpec` (which request fields ask for it, which ``meta_info`` entry holds it, and
which request field tells the engine where to start), and provides an :class:`EngineCapture` that
joins what the calls returned into one stash value. The generators (and the session server, which
receives the specs when a session is created) do the rest without knowing what the data means:

1. every generate request gets ``spec.request_fields``, and ``spec.start_field`` set to the first
   position whose data the caller does not hold yet (0 on a first turn; on a later turn of a
   conversation, the positions the earlier turns already reported are not asked for again);
2. each answer yields a :class:`CapturedPiece`: the payload as the engine returned it, covering
   positions ``[start, prompt_tokens + completion_tokens - 1)`` (the last sampled token was never
   fed to the model, so it has no data);
3. once the sample's tokens are final, the pieces are clipped to the positions that survive into
   the sample (a turn's trailing tokens that the next turn's prompt replaced are cut), checked to
   tile ``[0, len(tokens) - 1)`` exactly -- a gap or an overlap is an error, never patched -- and
   :meth:`EngineCapture.stitch` turns them into the value stored under ``capture.key``.

A sample that should carry a capture but does not (the engine sent no payload, the pieces do not
tile) is marked FAILED with exit reason ``missing_capture``: it is dropped and counted, never
trained without the data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from miles_contracts.sample import StashKey

RESERVED_REQUEST_FIELDS = frozenset(
    {"text", "input_ids", "sampling_params", "rid", "stream", "return_logprob", "logprob_start_len"}
)
"""Generate-request fields the generators own; a capture may not set them."""


class CaptureError(ValueError):
    """Captured pieces that cannot form one sample's data (missing, a gap, an overlap)."""


class CaptureSpec(BaseModel):
    """What to ask engines for, as plain data (it travels to session servers).

    :ivar name: the capture's name, owned by its plugin (``r3.routed_experts``); records key their
        payloads by it.
    :ivar request_fields: generate-request fields set on every call (``{"return_routed_experts":
        true}``).
    :ivar start_field: generate-request field that receives the first position the call must
        report (SGLang's ``routed_experts_start_len``); None: every call reports from position 0.
    :ivar meta_info_key: the ``meta_info`` entry of the answer that holds the payload.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=128)
    request_fields: dict[str, Any] = Field(default_factory=dict, max_length=16)
    start_field: str | None = None
    meta_info_key: str = Field(min_length=1, max_length=128)

    @model_validator(mode="after")
    def _fields_are_generate_fields(self) -> CaptureSpec:
        from miles_contracts.wire.engine import GenerateRequest

        named = [*self.request_fields, *([self.start_field] if self.start_field else [])]
        reserved = sorted(n for n in named if n in RESERVED_REQUEST_FIELDS)
        if reserved:
            raise ValueError(f"capture {self.name!r} may not set {reserved}: the generators own those request fields")
        unknown = sorted(n for n in named if n not in GenerateRequest.model_fields)
        if unknown:
            raise ValueError(f"capture {self.name!r} names {unknown}, which are not generate-request fields")
        start = {self.start_field: 0} if self.start_field else {}
        GenerateRequest.model_validate({"input_ids": [0], **self.request_fields, **start})  # values of the right type
        return self


@dataclass(frozen=True, slots=True)
class CapturedPiece:
    """One engine call's payload for a capture, placed in the sample's positions.

    :ivar start: the first position the payload covers.
    :ivar rows: how many positions the payload covers (``[start, start + rows)``).
    :ivar stop: positions ``[start, stop)`` are wanted (``stop <= start + rows``; less when the
        call's trailing tokens did not survive into the sample).
    :ivar payload: the ``meta_info`` entry as the engine returned it; None when it sent none.
    """

    start: int
    rows: int
    stop: int
    payload: Any


class EngineCapture(Protocol):
    """A plugin's capture: the spec, the stash key of the result, and how pieces join (read-only:
    a frozen dataclass or class attributes satisfy it)."""

    @property
    def spec(self) -> CaptureSpec: ...

    @property
    def key(self) -> StashKey[Any]: ...

    def stitch(self, pieces: Sequence[CapturedPiece], positions: int) -> Any:
        """Join ``pieces`` (already checked to tile ``[0, positions)``, see :func:`check_tiling`)
        into the value stored under :attr:`key`. Raises :class:`CaptureError` for a payload it
        cannot read (wrong size, unknown encoding)."""
        ...


def check_tiling(pieces: Sequence[CapturedPiece], positions: int, *, name: str = "capture") -> None:
    """Raise :class:`CaptureError` unless ``pieces``, in order, cover ``[0, positions)`` exactly once."""
    if not pieces:
        raise CaptureError(f"{name}: no engine call reported it")
    cursor = 0
    for number, piece in enumerate(pieces):
        if piece.payload is None:
            raise CaptureError(f"{name}: engine call {number} returned no payload")
        if not piece.start <= piece.stop <= piece.start + piece.rows:
            raise CaptureError(f"{name}: call {number} wants positions [{piece.start}, {piece.stop}) "
                               f"but its payload covers [{piece.start}, {piece.start + piece.rows})")
        if piece.start != cursor:
            kind = "a gap" if piece.start > cursor else "an overlap"
            raise CaptureError(f"{name}: {kind} at call {number}: it starts at position {piece.start}, "
                               f"the calls before it end at {cursor}")
        cursor = piece.stop
    if cursor != positions:
        raise CaptureError(f"{name}: the calls cover positions [0, {cursor}), the sample needs [0, {positions})")
