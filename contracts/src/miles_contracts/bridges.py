"""What a train backend asks of a model bridge beyond :class:`~miles_contracts.ModelBridge`'s
methods: whether a conversion takes ``partial=True`` (then weights stream one decoder layer at a
time), and which decoder layer an HF checkpoint tensor belongs to (the unit of that streaming)."""

from __future__ import annotations

import inspect
import re
from typing import Any

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def takes_partial(method: Any) -> bool:
    """Whether a bridge's ``to_hf`` / ``to_megatron`` takes the optional ``partial`` keyword."""
    try:
        return "partial" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def decoder_layer(hf_name: str) -> int | None:
    """The decoder layer of HF tensor ``hf_name`` (``model.layers.<i>.``...), None for the rest
    (embeddings, final norm, output layer)."""
    found = _LAYER.search(hf_name)
    return int(found.group(1)) if found else None
