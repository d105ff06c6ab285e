"""What the agent examples' tests share (``examples/conftest.py`` puts this folder on the path).

* real servers: the embedded engine on the tiny random model (a subprocess) and a session server in
  front of it (uvicorn in a thread of the test), as ``miles train`` starts them;
* :func:`run_episode`: one agent episode the way the ``agentic`` generator runs it (open the first
  session with the run's token, run the agent with the session's key, delete the session, assemble
  the rows with the generator's own :func:`~miles_tito.generators.agentic.episode_rows`), keeping
  the final session views the generator throws away, so a test can check the rows against them;
* :func:`assert_every_model_token_trained_once`: the trajectory graph's promise;
* :class:`TrainRuns`: ``miles train`` on the tiny model, each run in a temporary folder of its own,
  the runs of the examples' end-to-end tests started together (``examples/conftest.py``).
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from miles_contracts import Sample
from miles_contracts.testing.processes import LoggedProcess
from miles_contracts.wire.auth import auth_headers
from miles_contracts.wire.session import SessionView

ROOT = Path(__file__).resolve().parents[1]
Agent = Callable[[str, Any, dict[str, Any], dict[str, Any]], Awaitable[Any]]
# Short turns keep the tests fast; sampled, so the tiny model's turns differ (a greedy tiny model
# repeats itself, and identical turns are still distinct nodes, but less telling).
REQUEST_KWARGS = {"max_tokens": 8, "temperature": 1.0, "top_p": 1.0}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def engine(model: Path, log: Path) -> Iterator[str]:
    """``python -m miles_engine`` on ``model``; yields its URL once /health answers."""
    port = _free_port()
    argv = [sys.executable, "-m", "miles_engine", "--model", str(model), "--port", str(port)]
    with LoggedProcess(argv, log, env={"HF_HUB_OFFLINE": "1"}) as process:
        url = f"http://127.0.0.1:{port}"
        process.wait_healthy(url)
        yield url


@contextlib.contextmanager
def session_server(engine_url: str, model: Path) -> Iterator[str]:
    """A session server (ChatML, the tiny model's tokenizer) in front of ``engine_url``."""
    from miles.context import context_for
    from miles_tito.server.background import BackgroundServer
    from miles_tito.server.factory import app_factory, load_tito

    tito = load_tito(model, "chatml", kernel=context_for().kernel)
    make = app_factory(engine_url, tito, model_name="tiny", max_context_len=4096, default_max_tokens=8)
    with BackgroundServer(make) as server:
        yield server.url


async def run_episode(server: str, agent: Agent, prompt: str, *, label: str | None = None,
                      metadata: dict[str, Any] | None = None, role: str = "agent") -> tuple[Sample, SessionView]:
    """Run ``agent`` once as the ``agentic`` generator does; the assembled episode sample and the
    first session's final view (its ``children``: the episode's other sessions)."""
    from miles_tito.generators.agentic import episode_rows

    messages = [{"role": "user", "content": prompt}]
    sample = Sample(prompt=messages, label=label, metadata=dict(metadata or {}))
    async with httpx.AsyncClient(base_url=server, headers=auth_headers(), timeout=120, trust_env=False) as http:
        created = (await http.post("/sessions", json={"metadata": sample.metadata, "role": role})).json()
        try:
            result = await agent(created["base_url"], messages, dict(REQUEST_KWARGS),
                                 {**sample.metadata, "api_key": created["api_key"], "session_id": created["session_id"]})
            sample.metadata["agent_result"] = result
        finally:
            deleted = await http.delete(f"/sessions/{created['session_id']}")
    deleted.raise_for_status()
    view = SessionView.model_validate(deleted.json())
    episode_rows(sample, view, [])
    return sample, view


def assert_every_model_token_trained_once(sample: Sample, view: SessionView) -> None:
    """Each generated turn of every session of the episode is trained (``loss_mask`` 1) in exactly
    one of ``[sample, *sample.branches]``, with the ids the engine sampled for it (less at most the
    family's trailing trim), and nothing else is trained."""
    sessions = {s.session_id: s for s in [view, *view.children]}
    trained: Counter[tuple[str, int]] = Counter()
    for row in [sample, *sample.branches]:
        assert row.branch is not None
        row.validate()
        session = sessions[row.branch.session_id]
        last = max(r.turn for r in session.records if r.branch == row.branch.branch_id)
        path = session.path(last)
        spans = row.metadata["tito"]["turn_spans"]
        assert len(spans) == len(path)
        response = row.response_tokens
        masked = 0
        for record, (start, end) in zip(path, spans, strict=True):
            mask = row.loss_mask[start:end]
            if record.branch != row.branch.branch_id:
                assert set(mask) <= {0}, f"turn {record.turn} of another branch is trained in branch {row.branch.branch_id}"
                continue
            assert mask == [1] * (end - start) and end > start
            ids = response[start:end]
            assert ids == record.output_ids[: len(ids)]
            assert len(record.output_ids) - len(ids) <= view.max_trim_tokens
            trained[(session.session_id, record.turn)] += 1
            masked += end - start
        assert sum(row.loss_mask) == masked, "a token outside the branch's own turns is trained"
    generated = [(s.session_id, r.turn) for s in sessions.values() for r in s.records if not r.rolled_back]
    assert sorted(trained) == sorted(generated), "a generated turn is in no row"
    assert set(trained.values()) == {1}, "a generated turn is trained in two rows"


def branch_shape(sample: Sample) -> list[tuple[str, str]]:
    """``(role, cause)`` of each row, the primary first."""
    return [(row.branch.role, row.branch.cause) for row in [sample, *sample.branches] if row.branch is not None]


# ----------------------------------------------------------------------------- miles train


def train_args(config: Path, out: Path, model: Path, *overrides: str) -> list[str]:
    """``miles train <config>`` on the tiny model, 2 steps of 2 prompts x 2 samples, short turns; the
    run's folder is ``out / "e2e"``."""
    return [
        str(config), f"model.name={model}", f"run.output_dir={out}", "run.name=e2e", "run.steps=2",
        "run.dump_tokens=true", "run.save_final=false", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=8", "data.options={digits: 1}", "tito.family=chatml", *overrides,
    ]


class TrainRuns:
    """The examples' ``miles train`` runs (:func:`train_args`), started in the background, each in a
    folder of its own with its output in ``train.log`` there, so that the runs of several tests
    overlap; a run is named by its config and overrides.

    :param model: the tiny model every run trains.
    :param folder: a new empty folder for a run, from a name (``TempPathFactory.mktemp``).
    """

    def __init__(self, model: Path, folder: Callable[[str], Path]) -> None:
        self.model, self.folder = model, folder
        self.started: dict[tuple[Path, tuple[str, ...]], tuple[Path, LoggedProcess]] = {}

    def start(self, config: Path, *overrides: str) -> None:
        """Start the run unless it was started already."""
        key = (config, overrides)
        if key in self.started:
            return
        out = self.folder(config.parent.name)
        argv = [sys.executable, "-m", "miles.cli.main", "train", *train_args(config, out, self.model, *overrides)]
        process = LoggedProcess(argv, out / "train.log", cwd=ROOT, env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
        self.started[key] = out / "e2e", process.start()

    def finished(self, config: Path, *overrides: str) -> Path:
        """The run's folder, once the run (started now if it was not) has exited with status 0
        (``LoggedProcess.finished`` raises otherwise)."""
        self.start(config, *overrides)
        run, process = self.started[(config, overrides)]
        process.finished(f"the run of {config} to finish")
        return run

    def stop(self) -> None:
        """Stop every run still going, with whatever it started."""
        for _, process in self.started.values():
            process.stop()


def metrics(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def dumped(run: Path, step: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "samples" / f"step_{step:06d}.jsonl").read_text().splitlines()]
