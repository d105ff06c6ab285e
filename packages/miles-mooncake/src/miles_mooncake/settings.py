"""The ``mooncake`` config section (``weights.transport: mooncake``).

``weights.bucket_mb`` and ``weights.check`` (kernel) and ``weight_transport.pause_mode`` /
``http_timeout`` / ``check_seed`` (miles-weights) apply as to every transport; this section says how
the transfer engines connect.
"""

from __future__ import annotations

from typing import Literal

from miles.sections import Section
from pydantic import Field


class MooncakeSection(Section):
    protocol: Literal["tcp", "rdma"] = Field(
        default="tcp", description="rdma where the hosts have RDMA NICs (InfiniBand, RoCE); tcp anywhere",
    )
    device_name: str = Field(default="", description="RDMA devices of the trainer, e.g. 'mlx5_0,mlx5_1' (empty: discover)")
    hostname: str = Field(
        default="127.0.0.1", description="the address the trainer's transfer engine serves on and the engines reach "
        "it at: loopback (the default) when every engine is on the trainer's host; else this host's address on the "
        "private network the engines share. Mooncake listens on every interface and has no authentication; "
        "connections made to any other address are dropped",
    )
