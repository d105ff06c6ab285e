"""The ``prometheus`` config section."""

from __future__ import annotations

from miles.loopback import is_loopback_host
from pydantic import BaseModel, ConfigDict, Field, model_validator


class PrometheusSection(BaseModel):
    """Where the driver serves the run's metrics (``GET /metrics``, Prometheus' text format)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field(default="127.0.0.1", description="address to bind; loopback unless a scraper elsewhere needs it")
    port: int = Field(default=0, ge=0, le=65535, description="0 picks a free port (printed at start); fix one for a scrape config")
    require_token: bool = Field(
        default=True,
        description="scrapes send the run's token (Authorization: Bearer); false is allowed on a loopback host only",
    )

    @model_validator(mode="after")
    def _token_off_only_on_loopback(self) -> PrometheusSection:
        if not self.require_token and not is_loopback_host(self.host):
            raise ValueError(f"prometheus.require_token: false needs a loopback host, got {self.host!r}: anyone who "
                             "reaches that address could read the run's metrics; keep the token or bind 127.0.0.1")
        return self
