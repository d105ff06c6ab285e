"""The prometheus tracker serves exactly the logged metrics, to holders of the run's token only."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest
from miles.config import MilesConfig
from miles.context import context_for
from miles.kernel import Kernel
from miles.plugins import PluginSelection, load_plugins
from miles.sections import TrackingSection
from miles.tracking import open_trackers
from miles_contracts import Process
from miles_contracts.wire.auth import TOKEN_ENV
from pydantic import ValidationError

TOKEN = "prometheus-test-token-0123456789"


def scrape(url: str, token: str | None = TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(url, headers=headers, timeout=10)


def samples(text: str) -> dict[str, tuple[dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: (s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples}


def open_run(tmp_path: Path, **section: object):
    selection = PluginSelection(enable=("prometheus", "trackers"))
    kernel = Kernel(load_plugins(selection), selection)
    from miles_tracker_prometheus.config import PrometheusSection

    config = MilesConfig(tracking=TrackingSection(trackers=["prometheus"]), extra={"prometheus": PrometheusSection(**section)})
    run_dir = tmp_path / "run-a"
    return open_trackers(context_for(config, Process.driver(), run_dir=run_dir, kernel=kernel))


def test_a_scrape_sees_the_last_steps_metrics_with_the_runs_token(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    logger = open_run(tmp_path)
    try:
        assert logger.names == ["jsonl", "prometheus"]
        tracker = logger.others["prometheus"]
        logger.log({"reward/mean": 0.25, "eval/pass@1": float("nan"), "time/train": 3.0}, step=1)
        logger.log({"reward/mean": 0.5, "reward_mean": 9.0}, step=2)  # the second maps to a taken name
        answer = scrape(tracker.url)
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
        got = samples(answer.text)
        assert got["miles_reward_mean"] == ({"run": "run-a"}, 0.5)
        assert got["miles_time_train"] == ({"run": "run-a"}, 3.0)  # last value logged, from step 1
        assert math.isnan(got["miles_eval_pass_1"][1])
        assert got["miles_step"] == ({"run": "run-a"}, 2.0)
        assert "# HELP miles_reward_mean reward/mean" in answer.text
        # no token, a wrong one, another path, a body-carrying method: refused, and the server still serves
        assert scrape(tracker.url, token=None).status_code == 401
        assert scrape(tracker.url, token="x" * 32).status_code == 401
        assert scrape(tracker.url.replace("/metrics", "/other")).status_code == 404
        assert httpx.post(tracker.url, content=b"{}", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 405
        assert scrape(tracker.url).status_code == 200
    finally:
        logger.close()
    with pytest.raises(httpx.ConnectError):
        scrape(tracker.url)


def test_the_token_can_be_dropped_on_loopback_only(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    logger = open_run(tmp_path, require_token=False)
    try:
        tracker = logger.others["prometheus"]
        logger.log({"reward/mean": 1.0}, step=1)
        assert samples(scrape(tracker.url, token=None).text)["miles_reward_mean"][1] == 1.0
    finally:
        logger.close()
    from miles_tracker_prometheus.config import PrometheusSection

    with pytest.raises(ValidationError, match="needs a loopback host"):
        PrometheusSection(host="0.0.0.0", require_token=False)
