"""``PrometheusTracker``: the run's latest metrics as gauges on ``GET /metrics`` in the driver.

Every Miles metric ``a/b@c`` becomes a gauge ``miles_a_b_c`` (characters Prometheus does not allow
in names become ``_``; the original name is the gauge's help text) with a ``run`` label, plus
``miles_step``. A scrape sees the values of the last logged step; Prometheus keeps the history.
Two names that map to one gauge name keep the first and log a warning once.

The endpoint is a small threaded HTTP server in the driver (no body is read, one path, a 10 s
socket timeout) that requires the run's token like every other Miles route unless
``prometheus.require_token: false`` on a loopback host. A Prometheus scrape config sends it with
``authorization: {credentials_file: <a 0600 file holding the token>}``.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from miles_contracts.wire.auth import ensure_run_token, is_authorized

from miles_tracker_prometheus.config import PrometheusSection

if TYPE_CHECKING:
    from miles_contracts import RunContext

log = logging.getLogger(__name__)

PREFIX = "miles_"
_NOT_ALLOWED = re.compile(r"[^a-zA-Z0-9_:]")


def gauge_name(metric: str) -> str:
    """The Prometheus name of Miles metric ``metric`` (``reward/mean`` -> ``miles_reward_mean``)."""
    return PREFIX + _NOT_ALLOWED.sub("_", metric)


class PrometheusTracker:
    """Gauges in a registry of their own, served until :meth:`close`."""

    def __init__(self, section: PrometheusSection, run: str, token: str | None) -> None:
        from prometheus_client import CollectorRegistry, Gauge

        self._gauge_type = Gauge
        self.registry = CollectorRegistry()
        self.run = run
        self._gauges: dict[str, Any] = {}  # Miles metric name -> its labelled gauge
        self._owners: dict[str, str] = {}  # gauge name -> the Miles metric that took it
        self._step = self._new_gauge("miles_step", "the last step whose metrics were logged")
        self._server = _MetricsServer((section.host, section.port), self.registry, token)
        self._thread = threading.Thread(target=self._server.serve_forever, name="miles-prometheus", daemon=True)
        self._thread.start()
        port = self._server.server_address[1]
        self.url = f"http://{section.host}:{port}/metrics"
        log.info("prometheus: serving the run's metrics at %s%s", self.url, "" if token is None else " (run token required)")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            gauge = self._gauge_for(name)
            if gauge is not None:
                gauge.set(float(value))
        self._step.set(step)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def _gauge_for(self, metric: str) -> Any:
        if metric in self._gauges:
            return self._gauges[metric]
        name = gauge_name(metric)
        owner = self._owners.get(name)
        if owner is not None:
            log.warning("prometheus: metric %r maps to %s, already taken by %r; it is not exported", metric, name, owner)
            self._gauges[metric] = None
            return None
        self._owners[name] = metric
        self._gauges[metric] = gauge = self._new_gauge(name, metric)
        return gauge

    def _new_gauge(self, name: str, documentation: str) -> Any:
        return self._gauge_type(name, documentation, ["run"], registry=self.registry).labels(run=self.run)


class _MetricsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], registry: Any, token: str | None) -> None:
        self.registry = registry
        self.token = token
        super().__init__(address, _MetricsHandler)


class _MetricsHandler(BaseHTTPRequestHandler):
    server: _MetricsServer
    timeout = 10  # a client that sends nothing holds one thread for this long at most

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        token = self.server.token
        if token is not None and not is_authorized(self.headers.get("Authorization"), token):
            self._answer(401, b"send the run's token: Authorization: Bearer $MILES_AUTH_TOKEN\n",
                         extra={"WWW-Authenticate": "Bearer"})
            return
        if self.path.split("?", 1)[0] != "/metrics":
            self._answer(404, b"only GET /metrics is served here\n")
            return
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        self._answer(200, generate_latest(self.server.registry), content_type=CONTENT_TYPE_LATEST)

    def do_POST(self) -> None:  # noqa: N802
        self._answer(405, b"only GET /metrics is served here\n", extra={"Allow": "GET"})

    do_PUT = do_DELETE = do_PATCH = do_POST  # noqa: N815

    def _answer(self, status: int, body: bytes, *, content_type: str = "text/plain; charset=utf-8",
                extra: Mapping[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        log.debug("prometheus: " + format, *args)


def prometheus_tracker(ctx: RunContext) -> PrometheusTracker:
    """The tracker of the run of ``ctx`` (in the driver; the run's token guards its endpoint)."""
    section = ctx.config.section("prometheus", PrometheusSection)
    run = ctx.run_dir.name if ctx.run_dir is not None else "miles"
    token = ensure_run_token() if section.require_token else None
    return PrometheusTracker(section, run, token)


__all__ = ["PrometheusTracker", "gauge_name", "prometheus_tracker"]
