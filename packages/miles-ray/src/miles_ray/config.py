"""The ``ray`` config section: which Ray cluster the ``ray`` executor uses, and how."""

from __future__ import annotations

from typing import Annotated, Literal

from miles.sections import Privileged, Section
from pydantic import Field


class RaySection(Section):
    address: Annotated[str | None, Privileged("the Ray cluster that runs the run's processes, with their "
                                              "environment and the run's token")] = Field(
        default=None, description="Ray cluster to join (host:port of its head); null: RAY_ADDRESS if set, "
        "else start a Ray instance on this machine",
    )
    node_ip_address: str | None = Field(
        default=None, description="this machine's address as the cluster knows it (ray start --node-ip-address); "
        "null: Ray's guess",
    )
    gpu_resource: str = Field(
        default="GPU", description="the Ray resource that stands for one GPU; another name (a custom resource) "
        "places processes without giving them devices (tests on CPU clusters)",
    )
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        default="PACK", description="placement group strategy for the run's GPU bundles",
    )
    num_cpus: int | None = Field(default=None, ge=1, description="CPUs of a Ray instance started here; null: all")
    object_store_mb: int = Field(
        default=512, ge=100, description="object store of a Ray instance started here (Miles moves no tensors through it)",
    )
    forward_env: list[str] = Field(
        default_factory=lambda: ["HF_HUB_OFFLINE", "HF_HOME", "TRANSFORMERS_OFFLINE", "OMP_NUM_THREADS",
                                 "TOKENIZERS_PARALLELISM"],
        description="driver environment variables every process on the cluster gets (besides MILES_*)",
    )
    log_interval: float = Field(default=1.0, gt=0, description="seconds between copies of remote logs into <run>/logs")
    supervise_interval: float = Field(default=2.0, gt=0, description="seconds between liveness checks of processes")
