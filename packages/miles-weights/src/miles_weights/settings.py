"""The ``weight_transport`` config section: options of the transports in this package.

``weights.transport`` / ``weights.bucket_mb`` / ``weights.check`` (kernel section) choose the
transport and its bucket size; this section tunes how the transports talk to engines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from miles.sections import Section
from pydantic import Field


class WeightTransportSection(Section):
    pause_mode: Literal["abort", "retract", "in_place"] = Field(
        default="abort",
        description="how engines pause around an update: abort in-flight requests (they return finish "
        "reason abort), retract them (resumed after the update, KV recomputed), or keep them in place",
    )
    http_timeout: float = Field(default=600.0, gt=0, description="seconds an engine may take to answer one call")
    disk_dir: Path | None = Field(
        default=None, description="disk transport: folder for the safetensors (default <run dir>/weight_sync); "
        "engines must see it at the same path",
    )
    broadcast_backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto", description="broadcast transport: auto = nccl for CUDA tensors, gloo for CPU tensors",
    )
    broadcast_format: Literal["flattened_bucket", "per_tensor"] = Field(
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
