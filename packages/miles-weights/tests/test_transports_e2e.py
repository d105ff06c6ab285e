"""Every transport (``mooncake`` too, when miles-mooncake is installed) against real ``miles serve engine``
processes serving the tiny dense model."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from miles.config import MilesConfig
from miles.context import context_for
from miles.executor.local import free_port
from miles.sections import WeightsSection
from miles_contracts import Process
from miles_contracts.testing.transport import check_weight_transport
from miles_contracts.wire.auth import auth_headers
from miles_weights.errors import WeightCheckError, WeightSyncError
from miles_weights.launch import RunningEngines
from miles_weights.settings import WeightTransportSection
from miles_weights.sync import BucketedTransport

pytestmark = pytest.mark.slow
TRANSPORTS = ["disk", "shared_memory", "broadcast", "broadcast/per_tensor"]
if "mooncake" in context_for().kernel.weight_transports():  # miles-mooncake installed: held to the same tests
    TRANSPORTS.append("mooncake")
BUCKET_MB = 1  # the tiny model (~13 MB) then travels in many buckets


def make(name: str, tmp_path: Path, *, check: bool = False) -> BucketedTransport:
    """The transport registered as ``name``, configured like a run would configure it; ``name/layout``
    picks the broadcast layout (``weight_transport.broadcast_format``)."""
    name, _, layout = name.partition("/")
    section = WeightTransportSection(disk_dir=tmp_path / "sync", http_timeout=60, broadcast_format=layout or "flattened_bucket")
    config = MilesConfig(weights=WeightsSection(transport=name, bucket_mb=BUCKET_MB, check=check),
                         extra={"weight_transport": section})
    ctx = context_for(config, Process.trainer_rank(0))  # where a run creates its transport
    return ctx.kernel.weight_transports().get(name).create(ctx)


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BucketedTransport]:
    with make(request.param, tmp_path) as t:
        yield t


def _get(url: str, path: str) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url + path, headers=auth_headers()), timeout=30) as response:
        return json.loads(response.read())


def _greedy(url: str) -> tuple[list[int], list[float]]:
    """Greedy output ids and their log-probs (a random tiny model often repeats one token, so the
    log-probs are what tell two sets of weights apart)."""
    body = json.dumps({"input_ids": [1, 2, 3, 4, 5], "return_logprob": True,
                       "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}})
    request = urllib.request.Request(url + "/generate", data=body.encode(), headers={"Content-Type": "application/json", **auth_headers()})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.loads(response.read())
    return answer["output_ids"], [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]


def test_conformance_on_two_engines(transport: BucketedTransport, cpu_engines: dict[str, str],
                                    trainer_tensors: list) -> None:
    check_weight_transport(transport, [cpu_engines["a"], cpu_engines["b"]], trainer_tensors, version=11,
                           reference_url=cpu_engines["reference"])


def test_new_weights_change_generation_and_the_version(transport: BucketedTransport, cpu_engines: dict[str, str],
                                                       trainer_tensors: list) -> None:
    url = cpu_engines["a"]
    shuffled = [(n, t.flip(0).contiguous() if t.dim() == 2 else t) for n, t in trainer_tensors]  # other weights
    report = transport.push(shuffled, targets=[url], version=21)
    assert _get(url, "/get_model_info")["weight_version"] in ("21", 21)
    assert report.num_tensors == len(trainer_tensors) and report.num_buckets > 1 and report.gbps > 0
    assert _greedy(url) != _greedy(cpu_engines["reference"])
    transport.push(trainer_tensors, targets=[url], version=22)
    assert _greedy(url) == _greedy(cpu_engines["reference"])


def test_check_mode_names_the_tensors_a_sync_missed(tmp_path: Path, cpu_engines: dict[str, str],
                                                    trainer_tensors: list) -> None:
    url = cpu_engines["a"]
    skipped = trainer_tensors[3][0]
    with make("shared_memory", tmp_path, check=True) as transport:
        with pytest.raises(WeightCheckError, match="never sent and still hold noise") as caught:
            transport.push([(n, t) for n, t in trainer_tensors if n != skipped], targets=[url], version=31)
        assert caught.value.mismatches == {url: [skipped]}
        # a later full sync fixes the engine and passes the check
        assert transport.push(trainer_tensors, targets=[url], version=32).version == 32
    assert _greedy(url) == _greedy(cpu_engines["reference"])


def test_check_mode_catches_a_lossy_sync(tmp_path: Path, cpu_engines: dict[str, str], trainer_tensors: list) -> None:
    url = cpu_engines["b"]
    name = trainer_tensors[1][0]
    rounded = [(n, t.to(torch.bfloat16) if n == name else t) for n, t in trainer_tensors]  # fp32 engine, bf16 sent
    with make("disk", tmp_path, check=True) as transport:
        with pytest.raises(WeightCheckError, match=f"differ from the trainer's: {name}"):
            transport.push(rounded, targets=[url], version=41)
        transport.push(trainer_tensors, targets=[url], version=42)


def test_an_unreachable_engine_is_a_clear_error(transport: BucketedTransport, cpu_engines: dict[str, str],
                                                trainer_tensors: list) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    # most transports find out when pausing; mooncake already when it asks what the engines are
    with pytest.raises(WeightSyncError, match=rf"(version 51: pause generation|read the server info): cannot reach engine {dead}"):
        transport.push(trainer_tensors, targets=[cpu_engines["a"], dead], version=51)
    # the live engine stayed paused at its old version; the next sync without the dead one resumes it
    transport.push(trainer_tensors, targets=[cpu_engines["a"]], version=52)
    assert _greedy(cpu_engines["a"]) == _greedy(cpu_engines["reference"])


def test_a_rejected_bucket_names_engine_bucket_and_reason(transport: BucketedTransport, cpu_engines: dict[str, str],
                                                          trainer_tensors: list) -> None:
    url = cpu_engines["b"]
    name, tensor = trainer_tensors[2]
    wrong = [(n, t) for n, t in trainer_tensors if n != name] + [(name, torch.zeros(tensor.shape[0] + 1, *tensor.shape[1:]))]
    with pytest.raises(WeightSyncError) as caught:
        transport.push(wrong, targets=[url], version=61)
    message = str(caught.value)
    assert url in message and name in message and "version 61" in message
    if transport.name != "disk":  # disk loads one folder, not buckets
        assert "bucket" in message
    transport.push(trainer_tensors, targets=[url], version=62)
    assert _greedy(url) == _greedy(cpu_engines["reference"])


def test_broadcast_reuses_its_group_and_engines_leave_it(tmp_path: Path, cpu_engines: dict[str, str],
                                                         trainer_tensors: list) -> None:
    def engine_has(url: str, group: str) -> bool:
        # destroying is the only way to ask an engine whether it holds a group (a held one is gone afterwards)
        request = urllib.request.Request(f"{url}/destroy_weights_update_group", data=json.dumps({"group_name": group}).encode(),
                                         headers={"Content-Type": "application/json", **auth_headers()})
        try:
            with urllib.request.urlopen(request, timeout=30):
                return True
        except urllib.error.HTTPError as exc:
            assert b"no weight group" in exc.read()
            return False

    a, b = cpu_engines["a"], cpu_engines["b"]
    transport = make("broadcast", tmp_path)
    transport.push(trainer_tensors, targets=[a], version=71)
    first = transport.group_name
    transport.push(trainer_tensors, targets=[a], version=72)
    assert transport.group_name == first  # formed once, reused
    transport.push(trainer_tensors, targets=[a, b], version=73)
    second = transport.group_name
    assert second != first and not engine_has(a, first)  # new targets: a new group, the old one left
    transport.close()
    assert not engine_has(a, second) and not engine_has(b, second)


def test_broadcast_forms_a_new_group_when_an_engine_restarted(tmp_path: Path, cpu_engine_processes: RunningEngines,
                                                              cpu_engines: dict[str, str], trainer_tensors: list) -> None:
    b = cpu_engines["b"]
    with make("broadcast", tmp_path) as transport:
        transport.push(trainer_tensors, targets=[b], version=81)
        first = transport.group_name
        cpu_engine_processes.restart(1)  # what the executor does to a dead engine; the new process knows no group
        transport.push(trainer_tensors, targets=[b], version=82)
        assert transport.group_name != first
        assert _get(b, "/get_model_info")["weight_version"] == "82"
    assert _greedy(b) == _greedy(cpu_engines["reference"])
