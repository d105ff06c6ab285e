"""Answers the router gives itself when no engine could serve a request.

``/generate`` gets what SGLang sends for an aborted request -- HTTP 200 and
``meta_info.finish_reason = {"type": "abort", "message": <reason>}`` -- so a rollout records the
sample as aborted with the reason, exactly as for an engine-side abort, instead of handling a
transport error. The header ``X-Miles-Router-Abort`` tells the two apart. Any other path gets
HTTP 503 with ``{"detail": <reason>}``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from miles_contracts import RouterRequest, RouterResponse

ABORT_HEADER = "X-Miles-Router-Abort"
GENERATE_PATH = "/generate"


def router_abort(request: RouterRequest, kind: str, reason: str) -> RouterResponse:
    """``kind`` is a short code (``no_worker``, ``attempts_exhausted``, ``timeout``) for the header."""
    request.state["router_abort"] = reason
    headers = {ABORT_HEADER: kind}
    if request.path != GENERATE_PATH:
        return RouterResponse(status_code=503, body={"detail": reason}, headers=headers)
    body = request.body or {}
    return RouterResponse(status_code=200, body=_abort_bodies(body, reason), headers=headers)


def _abort_bodies(body: dict[str, Any], reason: str) -> dict[str, Any] | list[dict[str, Any]]:
    # SGLang batches when ``text`` is a list or ``input_ids`` a list of lists: one answer each.
    text, input_ids, rid = body.get("text"), body.get("input_ids"), body.get("rid")
    if isinstance(text, list):
        return [_abort_body(None, _nth(rid, i), reason) for i in range(len(text))]
    if isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
        return [_abort_body(ids, _nth(rid, i), reason) for i, ids in enumerate(input_ids)]
    return _abort_body(input_ids if isinstance(input_ids, list) else None, rid, reason)


def _nth(rid: Any, index: int) -> Any:
    return rid[index] if isinstance(rid, list) and index < len(rid) else None


def _abort_body(input_ids: list[Any] | None, rid: Any, reason: str) -> dict[str, Any]:
    return {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "id": rid if isinstance(rid, str) and rid else uuid.uuid4().hex,
            "finish_reason": {"type": "abort", "message": reason},
            "prompt_tokens": len(input_ids) if input_ids is not None else 0,
            "completion_tokens": 0,
            "cached_tokens": 0,
            "weight_version": None,
        },
    }


def abort_event(reason: str) -> bytes:
    """Server-sent events ending a stream whose engine died mid-answer (the leading blank line
    closes an event the engine may have left half-written)."""
    payload = _abort_body(None, None, reason)
    return b"\n\ndata: " + json.dumps(payload).encode() + b"\n\ndata: [DONE]\n\n"
