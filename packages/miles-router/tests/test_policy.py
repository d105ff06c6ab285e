"""The router's decisions without HTTP: URLs, selection, affinity, the fleet state machine and the
weight-version policy, the middleware chain, and the settings."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
from miles.errors import ConfigError
from miles_contracts import RouterRequest, RouterResponse
from miles_router.cli import add_arguments, section_from_args
from miles_router.config import RouterSection
from miles_router.fleet import Fleet, UnknownWorker
from miles_router.middleware import NamedMiddleware, compose
from miles_router.selection import AffinityTable, LeastInFlight
from miles_router.server import router_command
from miles_router.workers import InvalidWorkerUrl, WorkerState, normalize_worker_url

# ---------------------------------------------------------------------------------------- URLs


@pytest.mark.parametrize(("raw", "expected"), [
    ("http://127.0.0.1:30000", "http://127.0.0.1:30000"),
    ("  http://LocalHost:30000/ ", "http://localhost:30000"),
    ("https://engine.example:443", "https://engine.example:443"),
    ("http://[::1]:8000", "http://[::1]:8000"),
])
def test_worker_urls_are_normalised(raw: str, expected: str) -> None:
    assert normalize_worker_url(raw) == expected


@pytest.mark.parametrize(("raw", "says"), [
    ("127.0.0.1:30000", "must start with http://"),
    ("ftp://host:1", "must start with http://"),
    ("http://host:99999", "invalid port"),
    ("http://host:abc", "invalid port"),
    ("http://:30000", "no host"),
    ("http://host:1/generate", "without path or query"),
    ("http://host:1?x=1", "without path or query"),
    ("http://user:pw@host:1", "credentials"),
    ("", "non-empty string"),
    (42, "non-empty string"),
    ("http://[::1", "is not a URL"),  # urlsplit's ValueError was a 500 from POST /add_worker
    ("http://a\x00b:1", "give a DNS name"),  # httpx.InvalidURL in the first probe: a 500 too
    ("http://a b:1", "give a DNS name"),
])
def test_malformed_worker_urls_say_what_is_wrong(raw: object, says: str) -> None:
    with pytest.raises(InvalidWorkerUrl, match=says):
        normalize_worker_url(raw)


# ---------------------------------------------------------------------------------------- selection


def _fleet(*urls: str, threshold: int = 3) -> Fleet:
    fleet = Fleet(failure_threshold=threshold)
    for url in urls:
        worker, _ = fleet.add(url)
        fleet.record_alive(worker, "0")
        fleet.admit(worker)
    return fleet


A, B, C = "http://127.0.0.1:1001", "http://127.0.0.1:1002", "http://127.0.0.1:1003"


def test_least_in_flight_picks_the_least_loaded_and_spreads_ties() -> None:
    fleet = _fleet(A, B, C)
    policy = LeastInFlight(AffinityTable(16))
    fleet.get(A).in_flight, fleet.get(B).in_flight, fleet.get(C).in_flight = 3, 1, 2
    assert policy.choose(fleet.serving(), None).url == B
    assert policy.choose(fleet.serving(), None, exclude={B}).url == C
    # an idle fleet: the worker dispatched to least often goes first
    for worker in fleet:
        worker.in_flight = 0
    fleet.get(A).dispatched, fleet.get(B).dispatched, fleet.get(C).dispatched = 5, 5, 4
    assert policy.choose(fleet.serving(), None).url == C
    assert policy.choose(fleet.serving(), None, exclude={A, B, C}) is None


def test_affinity_sticks_while_the_worker_serves_then_moves_for_good() -> None:
    fleet = _fleet(A, B)
    policy = LeastInFlight(AffinityTable(16))
    first = policy.choose(fleet.serving(), "session-1")
    first.in_flight = 10  # load does not move a session away from its prefix cache
    assert policy.choose(fleet.serving(), "session-1") is first
    other = fleet.get(B if first.url == A else A)
    # the worker leaves: the key moves, and stays on the new worker after the first returns
    first.move_to(WorkerState.QUARANTINED, "test")
    assert policy.choose(fleet.serving(), "session-1") is other
    first.move_to(WorkerState.HEALTHY, None)
    first.in_flight = 0
    other.in_flight = 5
    assert policy.choose(fleet.serving(), "session-1") is other


def test_affinity_table_forgets_least_recently_used_keys() -> None:
    table = AffinityTable(2)
    table.set("a", A)
    table.set("b", B)
    assert table.get("a") == A  # "a" is now more recent than "b"
    table.set("c", C)
    assert (table.get("a"), table.get("b"), table.get("c")) == (A, None, C)


# ---------------------------------------------------------------------------------------- fleet


def test_quarantine_after_threshold_failures_and_readmission() -> None:
    fleet = _fleet(A, threshold=3)
    worker = fleet.get(A)
    fleet.record_failure(worker, "refused")
    fleet.record_failure(worker, "refused")
    assert worker.state is WorkerState.HEALTHY and worker.consecutive_failures == 2
    fleet.record_success(worker)  # any answer resets the count
    for _ in range(3):
        fleet.record_failure(worker, "refused")
    assert worker.state is WorkerState.QUARANTINED
    assert "3 consecutive failures; last: refused" in worker.reason
    assert fleet.record_alive(worker, "0") is True
    fleet.admit(worker)
    assert worker.state is WorkerState.HEALTHY and worker.consecutive_failures == 0


def test_a_worker_behind_the_fleet_does_not_rejoin_until_it_catches_up() -> None:
    fleet = _fleet(A, B)
    for worker in fleet:
        fleet.observe_version(worker, "4")
    assert fleet.version == "4"
    b = fleet.get(B)
    for _ in range(3):
        fleet.record_failure(b, "refused")
    # restarted from the initial checkpoint: version 0 must not serve beside version 4
    assert fleet.record_alive(b, "0") is False
    assert b.state is WorkerState.STALE_WEIGHTS and "behind the fleet's 4" in b.reason
    assert b in fleet.reachable() and b not in fleet.serving()
    # the next weight update reaches it too
    b.weight_version = "5"
    fleet.get(A).weight_version = "5"
    fleet.adopt_version("5")
    assert b.state is WorkerState.HEALTHY


def test_the_fleet_moves_forward_once_a_majority_of_serving_workers_has_the_newer_version() -> None:
    fleet = _fleet(A)
    worker, _ = fleet.add(B)
    assert fleet.record_alive(worker, "3") is True
    fleet.admit(worker)
    assert fleet.version == "0"  # one worker of two is not a majority
    fleet.observe_version(fleet.get(A), "3")
    assert fleet.version == "3"


def test_a_worker_claiming_a_far_newer_version_cannot_pin_the_fleet() -> None:
    fleet = _fleet(A, B)
    for worker in fleet:
        fleet.observe_version(worker, "4")
    liar, _ = fleet.add(C)
    assert fleet.record_alive(liar, str(10**9)) is True
    fleet.admit(liar)
    assert fleet.version == "4"
    b = fleet.get(B)
    for _ in range(3):
        fleet.record_failure(b, "refused")
    fleet.observe_version(fleet.get(A), "5")  # the next sync reaches A and, once back, B
    assert fleet.record_alive(b, "5") is True  # not locked out by the claim


def test_a_serving_worker_whose_version_goes_down_restarted_and_is_held_back() -> None:
    fleet = _fleet(A, B)
    a = fleet.get(A)
    fleet.observe_version(a, "2")
    fleet.observe_version(a, "0")
    assert a.state is WorkerState.STALE_WEIGHTS and "went back from 2 to 0" in a.reason


def test_a_failed_weight_update_takes_the_worker_out() -> None:
    fleet = _fleet(A, B)
    fleet.get(A).weight_version = "1"  # updated; B's update failed and it still has 0
    fleet.adopt_version("1")
    assert fleet.get(A).serving and fleet.get(B).state is WorkerState.STALE_WEIGHTS


def test_opaque_versions_compare_by_equality() -> None:
    fleet = _fleet(A)
    fleet.observe_version(fleet.get(A), "default")
    worker, _ = fleet.add(B)
    assert fleet.record_alive(worker, "other") is False
    assert fleet.record_alive(worker, "default") is True


def test_version_check_can_be_switched_off() -> None:
    fleet = Fleet(failure_threshold=1, check_weight_version=False)
    fleet.version = "9"
    worker, _ = fleet.add(A)
    assert fleet.record_alive(worker, "0") is True


def test_unknown_worker_lists_the_registered_ones() -> None:
    fleet = _fleet(A)
    with pytest.raises(UnknownWorker, match=f"not registered \\(registered: {A}\\)"):
        fleet.get(B)


# ---------------------------------------------------------------------------------------- middleware


def test_middleware_chain_runs_outermost_first() -> None:
    seen: list[str] = []

    def link(name: str):
        async def middleware(request: RouterRequest, call_next):
            seen.append(f"{name} in")
            response = await call_next(request)
            seen.append(f"{name} out")
            return response
        return NamedMiddleware(name, middleware)

    async def endpoint(request: RouterRequest) -> RouterResponse:
        seen.append("engine")
        return RouterResponse(200, {})

    handler = compose([link("a"), link("b")], endpoint)
    asyncio.run(handler(RouterRequest("POST", "/generate", {}, {})))
    assert seen == ["a in", "b in", "engine", "b out", "a out"]


# ---------------------------------------------------------------------------------------- settings


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


SECTION = RouterSection(middlewares=["metrics", "access_log"], middleware_options={"access_log": {"path": "x"}},
                        health_interval=0.25, failure_threshold=2, health_timeout=1.5, request_timeout=60,
                        max_attempts=4, affinity_capacity=10, check_weight_version=False, forward_client="httpx",
                        policy="cache_aware", prefix_max_imbalance=3)


def test_router_command_hands_the_router_its_config_file(tmp_path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({"router": SECTION.model_dump(mode="json")}))
    argv = router_command([A, B], port=31000, config_path=config, run_dir=tmp_path)
    assert argv[1:4] == ["-m", "miles_router", "--host"]
    args = _parse(argv[3:])
    assert section_from_args(args) == SECTION  # every setting, from the file
    assert (args.port, args.worker, args.run_dir) == (31000, [A, B], str(tmp_path))


def test_every_setting_has_a_flag_derived_from_the_section() -> None:
    flags = ["--middleware", "metrics", "--middleware", "access_log", "--middleware-options",
             json.dumps(SECTION.middleware_options), "--health-interval", "0.25", "--failure-threshold", "2",
             "--health-timeout", "1.5", "--request-timeout", "60", "--max-attempts", "4", "--affinity-capacity", "10",
             "--no-check-weight-version", "--forward-client", "httpx", "--policy", "cache_aware",
             "--prefix-max-imbalance", "3"]
    assert section_from_args(_parse(flags)) == SECTION
    assert set(RouterSection.model_fields) == {"middlewares", "middleware_options", "health_interval",
                                                "failure_threshold", "health_timeout", "request_timeout",
                                                "max_attempts", "affinity_capacity", "check_weight_version",
                                                "forward_client", "policy", "prefix_max_imbalance"}
    # a new setting: add its flag above


def test_bad_settings_fail_with_every_problem_listed(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse(["--health-interval", "0", "--max-attempts", "0"])
    with pytest.raises(ConfigError) as info:
        section_from_args(args)
    assert len(info.value.errors) == 2
    assert "router.health_interval" in str(info.value) and "router.max_attempts" in str(info.value)
    with pytest.raises(SystemExit):  # argparse refuses it before anything starts
        _parse(["--middleware-options", "{nope"])
    assert "--middleware-options: not valid JSON" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="not in middlewares"):
        section_from_args(_parse(["--middleware-options", '{"metrics": {}}']))


def test_config_file_then_flags_and_the_whole_config_is_validated(tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("router:\n  middlewares: [metrics]\n  failure_threshold: 7\nrollout:\n  max_new_tokens: 8\n")
    section = section_from_args(_parse(["--config", str(config), "--failure-threshold", "4"]))
    assert (section.middlewares, section.failure_threshold) == (["metrics"], 4)
    config.write_text("router:\n  failure_treshold: 7\n")
    with pytest.raises(ConfigError, match="router.failure_treshold: unknown key"):
        section_from_args(_parse(["--config", str(config)]))
    config.write_text("rollout:\n  num_engines: 2\n")  # the run's config as a whole, as every process reads it
    with pytest.raises(ConfigError, match="rollout.num_engines: moved to resources.engines"):
        section_from_args(_parse(["--config", str(config)]))


def test_new_requests_avoid_paused_workers_unless_every_serving_worker_is_paused() -> None:
    fleet = _fleet(A, B)
    a, b = fleet.get(A), fleet.get(B)
    a.paused = True  # its probe answered 503 {"status": "paused"}: alive, not a failure
    assert fleet.routable() == [b] and a.serving and a.consecutive_failures == 0
    b.paused = True  # a weight sync pauses every engine at once: requests queue on them meanwhile
    assert set(fleet.routable()) == {a, b}
    fleet.record_pause(None, [a, b])  # /continue_generation fanned out through the router
    assert not a.paused and not b.paused
