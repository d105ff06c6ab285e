"""LoRA runs on SGLang: each ``/generate`` names the adapter of the version its engine serves.

SGLang serves a run's adapters by name next to the base (``miles_sglang.lora``): version ``v`` is
adapter ``miles-v<v>``, and a request without ``lora_path`` is served by the base. The weight
transport (``sglang_lora``) loads a version's adapter on every engine and sets the engine's
``weight_version``; the router, which picks the engine of each request, adds that engine's
adapter to the body it forwards (the version it knows the engine holds: from its health probes and
from the ``weight_version`` of the engine's answers), so the caller's request stays the same.

Right after a sync the router may still know the engine at the version before for a moment (until
its next probe or answer): those requests are served by the previous adapter, which the transport
keeps loaded for this reason (and for requests admitted before the pause). The answer then carries
the version of the adapter that made its tokens, not the engine's newest: the router rewrites
``meta_info.weight_version`` to it, so a sample is never labelled with weights that did not
generate it.

Only a run with ``train.lora`` on ``rollout.engine: sglang`` does this (:func:`served_adapters`);
the embedded engine applies its one adapter to every request itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles.config import MilesConfig


@dataclass(frozen=True, slots=True)
class AdapterPerVersion:
    """``fields(engine_version)``: the body fields that pick the adapter of the version an engine
    serves; ``label(answer, fields)``: the answer marked with the version those fields picked."""

    def fields(self, engine_version: str | None) -> dict[str, str]:
        from miles_sglang.lora import request_fields

        if engine_version is None or not engine_version.isdigit():
            return {}  # not synced yet (or not a Miles version): the base
        return request_fields(int(engine_version))

    def label(self, body: Any, fields: dict[str, str]) -> None:
        """Set the ``weight_version`` of a generate answer (one, or a batch) to the version whose
        adapter made it (``fields`` were sent with it)."""
        from miles_sglang.lora import served_version

        version = str(served_version(fields))
        for answer in body if isinstance(body, list) else [body]:
            meta = answer.get("meta_info") if isinstance(answer, dict) else None
            if isinstance(meta, dict) and "weight_version" in meta:
                meta["weight_version"] = version


def served_adapters(config: MilesConfig) -> AdapterPerVersion | None:
    """What the run of ``config`` adds to its engines' requests: adapters per version for
    ``train.lora`` on SGLang engines, else nothing."""
    if config.train.lora is not None and config.rollout.engine == "sglang":
        return AdapterPerVersion()
    return None
