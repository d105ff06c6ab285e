"""The engine capture of routed experts: what to ask every engine call for, how turns join.

Requests carry SGLang's ``return_routed_experts: true``; a later turn of a conversation also
carries ``routed_experts_start_len`` (the positions earlier turns reported are not sent again), and
the answers' ``meta_info.routed_experts`` are stitched by position into :data:`ROUTED_EXPERTS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from miles_contracts import CapturedPiece, CaptureSpec, MoeLayerMap, StashKey

from miles_r3.experts import ROUTED_EXPERTS, RoutedExperts, stitch

ROUTED_EXPERTS_SPEC = CaptureSpec(
    name=ROUTED_EXPERTS.name,
    request_fields={"return_routed_experts": True},
    start_field="routed_experts_start_len",
    meta_info_key="routed_experts",
)


@dataclass(frozen=True, slots=True)
class RoutedExpertsCapture:
    """An :class:`~miles_contracts.EngineCapture` for one model's MoE layout."""

    layer_map: MoeLayerMap
    spec: ClassVar[CaptureSpec] = ROUTED_EXPERTS_SPEC
    key: ClassVar[StashKey[Any]] = ROUTED_EXPERTS

    def stitch(self, pieces: Sequence[CapturedPiece], positions: int) -> RoutedExperts:
        return stitch(pieces, positions, self.layer_map)
