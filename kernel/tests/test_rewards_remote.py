"""The remote reward against a real HTTP server on loopback (the standard library's, in a thread)."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from miles.config import MilesConfig
from miles.context import context_for
from miles.kernel import Kernel
from miles.plugins import PluginSelection, load_plugins
from miles.rewards import score_samples_blocking
from miles.rewards.remote import RemoteReward, RemoteRewardError
from miles.sections import RewardSection
from miles_contracts import Branch, ExitReason, Sample, Status
from miles_contracts.testing.reward import check_reward

RECEIVED: list[dict] = []
Answer = tuple[int, str, str]  # status, content type, body


def exact(body: dict) -> Answer:
    """A reward server: 1.0 when the response equals the label, null without a label."""
    RECEIVED.append(body)
    rewards = [None if s["label"] is None else float(s["response"].strip() == s["label"]) for s in body["samples"]]
    return 200, "application/json", json.dumps({"rewards": rewards})


def picky(body: dict) -> Answer:
    if any(s["response"] == "boom" for s in body["samples"]):
        return 422, "application/json", json.dumps({"detail": "cannot score 'boom'"}, separators=(",", ":"))
    return 200, "application/json", json.dumps([1.0] * len(body["samples"]))  # a bare list is accepted too


def short(body: dict) -> Answer:
    return 200, "application/json", json.dumps({"rewards": [1.0]})


def garbage(body: dict) -> Answer:
    return 200, "text/html", "<html>oops</html>"


def slow(body: dict) -> Answer:
    time.sleep(5)
    return 200, "application/json", json.dumps({"rewards": []})


def roles(body: dict) -> Answer:
    """A reward server of a two-agent game: the solver wins when its response equals the label; a
    response "forgets" leaves the sample's own role out."""
    RECEIVED.append(body)
    rewards = []
    for s in body["samples"]:
        won = float(s["response"] == s["label"])
        scores = {role: won if role == "solver" else 1.0 - won for role in s["roles"]}
        rewards.append({k: v for k, v in scores.items() if k != s["role"]} if s["response"] == "forgets" else scores)
    return 200, "application/json", json.dumps({"rewards": rewards})


ROUTES: dict[str, Callable[[dict], Answer]] = {f"/{f.__name__}": f for f in (exact, picky, short, garbage, slow, roles)}


class RewardHandler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # http.server dispatches a POST to do_POST
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        route = ROUTES.get(self.path)
        status, content_type, text = route(body) if route else (404, "text/plain", "not found")
        payload = text.encode()
        try:
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout tests)
            pass

    def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), RewardHandler)
    httpd.daemon_threads = True  # a handler still sleeping in `slow` must not hold up shutdown
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=10)


def completed(response: str, label: str | None, index: int = 0) -> Sample:
    return Sample(prompt=[{"role": "user", "content": "q"}], response=response, label=label, status=Status.COMPLETED,
                  index=index, metadata={"task": "t"})


def test_posts_the_batch_and_reads_the_rewards(server: str) -> None:
    RECEIVED.clear()
    reward = RemoteReward(url=f"{server}/exact")
    scores = asyncio.run(reward([completed("4", "4"), completed("5", "4"), completed("4", None)]))
    assert scores[:2] == [1.0, 0.0] and math.isnan(scores[2])
    assert len(RECEIVED) == 1  # one request for the whole batch
    assert RECEIVED[0]["samples"][0] == {"prompt": [{"role": "user", "content": "q"}], "response": "4", "label": "4",
                                         "metadata": {"task": "t"}}


def test_remote_reward_conforms(server: str) -> None:
    check_reward(RemoteReward(url=f"{server}/exact"))


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("picky", "answered HTTP 422: {\"detail\":\"cannot score 'boom'\"}"),
        ("short", "returned 1 rewards for 2 samples"),
        ("garbage", "answered with non-JSON"),
        ("missing", "answered HTTP 404"),
    ],
)
def test_bad_answers_are_clear_errors(server: str, path: str, message: str) -> None:
    with pytest.raises(RemoteRewardError, match="reward endpoint") as info:
        asyncio.run(RemoteReward(url=f"{server}/{path}")([completed("boom", "1"), completed("x", "1")]))
    assert message in str(info.value)


def test_unreachable_slow_and_unset_endpoints_are_clear_errors(server: str) -> None:
    with pytest.raises(RemoteRewardError, match=r"cannot reach reward endpoint http://127\.0\.0\.1:\d+/x: ConnectError"):
        asyncio.run(RemoteReward(url=f"http://127.0.0.1:{free_port()}/x")([completed("1", "1")]))
    with pytest.raises(RemoteRewardError, match=r"did not answer within 0\.2 s \(reward\.timeout\)"):
        asyncio.run(RemoteReward(url=f"{server}/slow", timeout=0.2)([completed("1", "1")]))
    with pytest.raises(RemoteRewardError, match="set reward.remote_url"):
        asyncio.run(RemoteReward()([completed("1", "1")]))


def test_score_binds_the_config_and_fails_only_rejected_samples(server: str) -> None:
    selection = PluginSelection(enable=("rewards",))
    kernel = Kernel(load_plugins(selection), selection)
    samples = [completed("fine", "1", 0), completed("boom", "1", 1)]
    report = score_samples_blocking(samples, context_for(MilesConfig(reward=RewardSection(name="remote", remote_url=f"{server}/picky")), kernel=kernel))
    assert samples[0].reward == 1.0
    assert samples[1].status is Status.FAILED and samples[1].exit_reason is ExitReason.REWARD_ERROR
    assert "HTTP 422" in samples[1].exit_detail
    assert (report.scored, report.failed) == (1, 1)


def test_a_loopback_reward_server_is_reached_past_an_http_proxy(server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy named by HTTP_PROXY (here: nothing listens there) serves the outside world; a remote
    reward on loopback is called directly (a remote one on another host would follow the proxy)."""
    from miles.loopback import PROXY_VARIABLES, is_loopback_url

    for name in PROXY_VARIABLES:
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    assert asyncio.run(RemoteReward(url=f"{server}/exact")([completed("4", "4")])) == [1.0]
    assert is_loopback_url("http://localhost:8000/score") and is_loopback_url("http://127.0.0.2/x")
    assert is_loopback_url("http://[::1]:80/") and not is_loopback_url("https://rewards.example.com/score")


def test_a_remote_reward_may_score_each_role_of_an_episode(server: str) -> None:
    """The endpoint is told each episode's roles and answers {role: reward}; a mapping without the
    sample's own role fails that sample only."""
    RECEIVED.clear()
    samples = [completed("4", "4", 0), completed("5", "4", 1), completed("forgets", "4", 2)]
    for s in samples:
        s.branch = Branch(episode_id=f"e{s.index}", branch_id=0, role="solver")
        s.branches = [Sample(branch=Branch(episode_id=f"e{s.index}", branch_id=1, role="critic", cause="subagent"))]
    selection = PluginSelection(enable=("rewards",))
    kernel = Kernel(load_plugins(selection), selection)
    config = MilesConfig(reward=RewardSection(name="remote", remote_url=f"{server}/roles"))
    report = score_samples_blocking(samples, context_for(config, kernel=kernel))
    assert RECEIVED[0]["samples"][0]["role"] == "solver" and RECEIVED[0]["samples"][0]["roles"] == ["critic", "solver"]
    assert [s.reward for s in samples[:2]] == [1.0, 0.0]
    assert samples[1].role_rewards == {"solver": 0.0, "critic": 1.0}
    assert samples[2].status is Status.FAILED and "without the sample's own role 'solver'" in samples[2].exit_detail
    assert (report.scored, report.failed) == (2, 1)
