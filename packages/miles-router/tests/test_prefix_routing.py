"""Cache-aware placement (``router.policy: cache_aware``): the policy alone over a fleet, then a router
in front of two real embedded engines (tiny model, in this process, on loopback) whose radix caches
report what the placement saved."""

from __future__ import annotations

import pytest
from miles_router.fleet import Fleet
from miles_router.middleware import NamedMiddleware
from miles_router.middlewares.metrics import MetricsMiddleware
from miles_router.prefix_routing import TOKEN_BLOCK, CacheAware, PrefixIndex, prefix_blocks
from miles_router.proxy import WORKER_HEADER
from miles_router.selection import AffinityTable
from router_support import ThreadedServer, router_for

A, B, C = "http://127.0.0.1:1001", "http://127.0.0.1:1002", "http://127.0.0.1:1003"


def _fleet(*urls: str) -> Fleet:
    fleet = Fleet(failure_threshold=3)
    for url in urls:
        worker, _ = fleet.add(url)
        fleet.record_alive(worker, "0")
        fleet.admit(worker)
    return fleet


def _prompt(seed: int, length: int) -> dict:
    return {"input_ids": [(seed * 7919 + i * 31) % 5000 + 3 for i in range(length)]}


def test_prefix_blocks_chain_whole_blocks_of_tokens_or_characters() -> None:
    hashes, length = prefix_blocks({"input_ids": list(range(40))})
    assert length == 40 and len(hashes) == 40 // TOKEN_BLOCK
    longer, _ = prefix_blocks({"input_ids": list(range(40)) + [7] * 30})
    assert longer[: len(hashes)] == hashes  # a longer prompt extends the chain
    other, _ = prefix_blocks({"input_ids": [99] + list(range(1, 40))})
    assert not set(other) & set(hashes)  # one token changed in block 0: every hash differs
    assert prefix_blocks({"text": "x" * 130})[0] and prefix_blocks({"text": ["a", "b"]}) == ([], 0)
    assert prefix_blocks({"input_ids": [[1, 2], [3]]}) == ([], 0) and prefix_blocks(None) == ([], 0)


def test_the_worker_sent_the_longest_prefix_wins_within_the_load_bound() -> None:
    fleet = _fleet(A, B, C)
    policy = CacheAware(AffinityTable(16), max_imbalance=2)
    first = policy.choose(fleet.serving(), None, body=_prompt(1, 64))
    assert first is not None
    first.dispatched += 1
    # the next turn re-sends the history and more: it follows the history
    turn_two = _prompt(1, 64)["input_ids"] + [11] * 40
    assert policy.choose(fleet.serving(), None, body={"input_ids": turn_two}) is first
    # an unrelated prompt goes to the least busy, least used worker
    first.in_flight = 1
    other = policy.choose(fleet.serving(), None, body=_prompt(2, 64))
    assert other is not None and other is not first
    # within the bound the prefix (now all 6 blocks of turn two) still wins; beyond it, load does
    first.in_flight = 2
    assert policy.choose(fleet.serving(), None, body={"input_ids": turn_two}) is first
    first.in_flight = 3
    moved = policy.choose(fleet.serving(), None, body={"input_ids": turn_two})
    assert moved is not first
    stats = policy.snapshot()
    assert stats["requests"] == 5 and stats["placed_on_prefix"] == 2 and stats["held_back_for_load"] == 1
    assert stats["matched_tokens"] == 64 + 96 and 0 < stats["hit_rate"] < 1


def test_keyed_requests_keep_their_affinity_and_the_index_forgets_old_blocks() -> None:
    fleet = _fleet(A, B)
    policy = CacheAware(AffinityTable(16), max_imbalance=8, index=PrefixIndex(capacity=4))
    keyed = policy.choose(fleet.serving(), "session-9", body=_prompt(3, 64))
    assert keyed is not None and policy.snapshot()["requests"] == 0  # affinity decided, not the prefix
    keyed.in_flight = 1
    assert policy.choose(fleet.serving(), "session-9", body=_prompt(4, 64)) is keyed
    unkeyed = policy.choose(fleet.serving(), None, body=_prompt(5, 64))
    assert unkeyed is not None
    policy.choose(fleet.serving(), None, body=_prompt(6, 64))
    assert policy.index.matched(unkeyed.url, prefix_blocks(_prompt(5, 64))[0]) == 0  # 4 blocks kept: prompt 6's


@pytest.fixture(scope="module")
def embedded_pair():
    from miles_engine import Engine, create_app
    from miles_models.testing import tiny_model

    path = tiny_model("dense")
    engines = [Engine(path, device="cpu", max_running_requests=8, disable_radix_cache=False) for _ in range(2)]
    servers = [ThreadedServer(create_app(engine)).start() for engine in engines]
    try:
        yield servers
    finally:
        for server, engine in zip(servers, engines, strict=True):
            server.stop()
            engine.shutdown()


def test_sessions_without_keys_follow_their_prefix_across_real_engines(embedded_pair) -> None:
    urls = [s.url for s in embedded_pair]
    metrics = MetricsMiddleware()
    with router_for(urls, middlewares=[NamedMiddleware("metrics", metrics, metrics)], policy="cache_aware") as client:
        histories = [_prompt(10 + s, 40)["input_ids"] for s in range(4)]
        placed: dict[int, set[str]] = {s: set() for s in range(4)}
        cached = []
        for turn in range(3):
            for session, history in enumerate(histories):
                answer = client.post("/generate", json={
                    "input_ids": history, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True,
                                                              "temperature": 0.0}})
                assert answer.status_code == 200, answer.text
                placed[session].add(answer.headers[WORKER_HEADER])
                cached.append(answer.json()["meta_info"]["cached_tokens"])
                history += answer.json()["output_ids"] + [turn + 5] * 20
        snapshot = client.get("/metrics").json()
        prometheus = client.get("/metrics", params={"format": "prometheus"}).text
    assert all(len(workers) == 1 for workers in placed.values()), placed  # each session stayed put
    assert len(set().union(*placed.values())) == 2  # and the sessions were spread over both engines
    assert cached[:4] == [0, 0, 0, 0] and all(c > 0 for c in cached[4:])
    routing = snapshot["prefix_routing"]
    assert routing["requests"] == 12 and routing["placed_on_prefix"] == 8
    total = snapshot["metrics"]["total"]
    assert total["tokens"]["cached"] == sum(cached) and 0 < total["prefix_cache_hit_rate"] < 1
    assert 'miles_router_prefix_tokens_total{kind="matched"}' in prometheus
    assert 'kind="cached"' in prometheus

