"""The ``weight_transport`` config section: options of the transports in this package.

``weights.transport`` / ``weights.bucket_mb`` / ``weights.check`` (kernel section) choose the
transport and its bucket size; this section tunes how the transports talk to engines.

Every option is declared once, here (or in the kernel's ``weights`` section): its type, default,
bounds and description. :class:`miles_weights.sync.TransportOptions` copies the fields every
transport shares from these declarations, the broadcast transport checks its arguments against
the literals below, and ``miles bench weights`` takes its flags' defaults, choices and help from
the same fields (:func:`declared`, :func:`flag_help`).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal, get_args

from miles.sections import Section
from pydantic import BaseModel, Field
from pydantic.fields import FieldInfo

PauseMode = Literal["abort", "retract", "in_place"]
BroadcastBackend = Literal["auto", "gloo", "nccl"]
BroadcastFormat = Literal["flattened_bucket", "per_tensor"]  # flattened_bucket: miles_contracts.wire.distributed
BROADCAST_BACKENDS: tuple[str, ...] = get_args(BroadcastBackend)
BROADCAST_LAYOUTS: tuple[str, ...] = get_args(BroadcastFormat)


class WeightTransportSection(Section):
    pause_mode: PauseMode = Field(
        default="abort",
        description="how engines pause around an update: abort in-flight requests (they return finish "
        "reason abort), retract them (resumed after the update, KV recomputed), or keep them in place",
    )
    http_timeout: float = Field(default=600.0, gt=0, description="seconds an engine may take to answer one call")
    disk_dir: Path | None = Field(
        default=None, description="disk transport: folder for the safetensors (default <run dir>/weight_sync); "
        "engines must see it at the same path",
    )
    broadcast_backend: BroadcastBackend = Field(
        default="auto", description="broadcast transport: auto = nccl for CUDA tensors, gloo for CPU tensors",
    )
    broadcast_format: BroadcastFormat = Field(
        default="flattened_bucket", description="broadcast transport: one collective per bucket over its bytes "
        "packed back to back (engines must accept load_format flattened_bucket, as the embedded engine and SGLang "
        "do), or one collective per tensor",
    )
    master_address: str | None = Field(
        default=None, description="broadcast transport: address engines use to reach the trainer "
        "(default: 127.0.0.1 for local engines, else this host's address on the route to the first engine)",
    )
    master_port: int | None = Field(default=None, ge=1, le=65535, description="broadcast transport: default a free port")
    check_seed: int = Field(default=0, description="seed of the noise engines fill their weights with (check mode)")


def default_of(section: type[BaseModel], name: str) -> Any:
    """The default ``section`` declares for ``name``."""
    return section.model_fields[name].get_default(call_default_factory=True)


def declared(section: type[BaseModel], name: str) -> FieldInfo:
    """A copy of ``section``'s declaration of ``name`` (default, bounds, description), to declare
    the same option elsewhere without writing it again."""
    try:
        return copy.copy(section.model_fields[name])
    except KeyError:
        raise KeyError(f"{section.__name__} declares no option {name!r}") from None


def flag_help(key: str, section: type[BaseModel], name: str, extra: str = "") -> str:
    """``--flag`` help naming the config key it stands for, with the key's own description."""
    description = section.model_fields[name].description
    return f"{key}{': ' + description if description else ''}{extra}"


def same_types(model: type[BaseModel], sources: dict[str, type[BaseModel]]) -> None:
    """Raise unless every field of ``model`` has the type its source section declares (so a copied
    option cannot drift from its declaration)."""
    for name, source in sources.items():
        ours: Any = model.model_fields[name].annotation
        theirs: Any = source.model_fields[name].annotation
        if ours != theirs:
            raise TypeError(f"{model.__name__}.{name} is {ours}, but {source.__name__}.{name} (its declaration) "
                            f"is {theirs}")
