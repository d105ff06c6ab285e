"""The ``router`` config section (registered by this package): how the router a run starts
behaves. It is also the table of ``miles serve router``'s settings flags (one per field, derived by
:mod:`miles.cli.section_args`), which are validated as keys of this section."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from miles.sections import Choice, Section
from pydantic import Field, model_validator


class RouterSection(Section):
    middlewares: list[Annotated[str, Choice("router_middleware")]] = Field(default_factory=list)
    health_interval: float = Field(default=5.0, gt=0, description="seconds between health probes of each worker")
    failure_threshold: int = Field(default=3, ge=1, description="failures in a row that quarantine a worker")
    middleware_options: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="options per middleware name, passed to its factory"
    )
    health_timeout: float = Field(default=5.0, gt=0, description="seconds a health probe may take")
    request_timeout: float = Field(default=3600.0, gt=0, description="seconds an engine may take to answer one request")
    max_attempts: int = Field(default=3, ge=1, description="engines one request may be tried on (failover)")
    affinity_capacity: int = Field(default=100_000, ge=1, description="routing keys remembered for session affinity")
    policy: Literal["least_in_flight", "cache_aware"] = Field(
        default="least_in_flight", description="placement of requests without a routing key: least_in_flight, or "
        "cache_aware (the worker that was sent the longest prefix of the prompt, within prefix_max_imbalance)",
    )
    prefix_max_imbalance: int = Field(
        default=8, ge=0, description="cache_aware: a worker may have this many more requests in flight than the "
        "least busy one and still win on its prefix",
    )
    check_weight_version: bool = Field(
        default=True, description="hold back a worker whose weight_version is behind the fleet's"
    )
    forward_client: Literal["lean", "httpx"] = Field(
        default="lean", description="HTTP client for non-streamed requests: miles.http11 (fast) or httpx (the "
                                    "baseline of `miles bench rollout-path`); neither uses HTTP_PROXY"
    )

    @model_validator(mode="after")
    def _options_name_a_middleware(self) -> RouterSection:
        unused = sorted(set(self.middleware_options) - set(self.middlewares))
        if unused:
            raise ValueError(
                f"middleware_options given for {unused} which are not in middlewares {self.middlewares}; "
                "add them to router.middlewares or drop their options"
            )
        return self
