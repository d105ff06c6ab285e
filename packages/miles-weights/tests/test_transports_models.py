"""Check mode through every CPU transport on the two model shapes that broke it.

- A tied Llama (``tie_word_embeddings``) built like ``miles bench weights --random-model`` builds
  its models (``randn * 0.02`` from ``manual_seed(0)``, bf16), served in bf16. The checkpoint holds
  no ``lm_head``: the trainer sends the embedding alone and the engine's head must follow it. (The
  H200 attempt failed here: the engines' noise, drawn from the same generator and seed, equalled
  the model's embedding bit for bit, so the tied head looked "never sent, still noise".)
- The tiny Qwen3-MoE, whose experts transformers fuses in memory while trainers send the
  checkpoint's per-expert names. Afterwards generation and the routed experts must equal a model
  loaded from the pushed weights.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from miles.config import MilesConfig
from miles.context import context_for
from miles.sections import WeightsSection
from miles_contracts import Process
from miles_contracts.wire.auth import auth_headers
from miles_models.testing import router_top_k
from miles_weights.settings import WeightTransportSection
from miles_weights.sync import BucketedTransport

pytestmark = pytest.mark.slow
TRANSPORTS = ["disk", "shared_memory", "broadcast"]
TINY_LLAMA = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)


def make(name: str, tmp_path: Path, *, check: bool) -> BucketedTransport:
    config = MilesConfig(weights=WeightsSection(transport=name, bucket_mb=1, check=check),
                         extra={"weight_transport": WeightTransportSection(disk_dir=tmp_path / "sync", http_timeout=60)})
    ctx = context_for(config, Process.trainer_rank(0))  # where a run creates its transport
    return ctx.kernel.weight_transports().get(name).create(ctx)


def _post(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **auth_headers()})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _greedy(url: str, prompt: list[int], **extra) -> dict:
    return _post(url, "/generate", {"input_ids": prompt, "return_logprob": True, **extra,
                                    "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}})


def _logprobs(answer: dict) -> list[float]:
    return [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]


# ---------------------------------------------------------------------------------------- tied Llama


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles_models.testing import tiny_model
    from miles_weights.bench_models import LlamaShape, random_llama

    folder = random_llama(LlamaShape(**TINY_LLAMA), tiny_model("dense"), tmp_path_factory.mktemp("random"), seed=0)
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is True
    return folder


@pytest.fixture(scope="module")
def tied_engines(tied_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """``target`` (synced) and ``reference`` (never touched), both bf16 on CPU."""
    from miles_weights.launch import EngineLaunch, running_engines

    with running_engines(tied_dir, [EngineLaunch("cpu", "bfloat16")] * 2, tmp_path_factory.mktemp("tied"),
                         weight_dirs=[tmp_path_factory.getbasetemp()], together=True) as engines:
        yield dict(zip(["target", "reference"], engines.urls, strict=True))


@pytest.mark.parametrize("name", TRANSPORTS)
def test_check_mode_passes_on_a_tied_random_llama(name: str, tied_dir: Path, tied_engines: dict[str, str],
                                                  tmp_path: Path) -> None:
    from miles_weights.bench_models import load_tensors

    tensors = load_tensors(tied_dir, torch.bfloat16, "cpu")
    names = [n for n, _ in tensors]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # the head is tied, not stored
    url = tied_engines["target"]
    with make(name, tmp_path, check=True) as transport:  # noise first, then the sync must restore every byte
        report = transport.push(iter(tensors), targets=[url], version=3)
    assert report.num_tensors == len(tensors) and report.checked_engines == (url,)
    checksums = json.loads(urllib.request.urlopen(urllib.request.Request(url + "/weights_checksum", headers=auth_headers()), timeout=60).read())["checksums"]
    assert set(checksums) == set(names)  # one name per stored tensor: the tied head is not reported apart
    # the head was never sent and was noise: only the tie can have restored it
    prompt = [1, 504, 3458, 282]
    got, expected = _greedy(url, prompt), _greedy(tied_engines["reference"], prompt)
    assert got["output_ids"] == expected["output_ids"] and _logprobs(got) == _logprobs(expected)


def test_a_tied_alias_sent_beside_its_partner_travels_once(tied_dir: Path, tied_engines: dict[str, str],
                                                           tmp_path: Path) -> None:
    """A trainer passing a tied model's full state_dict (``lm_head.weight`` is the embedding under a
    second name) sends the bytes once, and check mode passes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tied_dir, dtype=torch.bfloat16)
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    with make("shared_memory", tmp_path, check=True) as transport:
        report = transport.push(iter(state.items()), targets=[tied_engines["target"]], version=4)
    assert report.num_tensors == len(state) - 1


# ---------------------------------------------------------------------------------------- Qwen3-MoE


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An fp32 CPU engine serving the tiny MoE of seed 0; the syncs push the one of seed 1."""
    from miles_models.testing import tiny_model
    from miles_weights.launch import EngineLaunch, running_engines

    with running_engines(tiny_model("moe"), [EngineLaunch("cpu", "float32")], tmp_path_factory.mktemp("moe"),
                         weight_dirs=[tmp_path_factory.getbasetemp()]) as engines:
        yield engines.urls[0]


@pytest.fixture(scope="module")
def moe_trained():
    from miles_models.testing import tiny_model
    from transformers import AutoModelForCausalLM

    path = tiny_model("moe", seed=1)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _reference_greedy(model, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("name", TRANSPORTS)
def test_check_mode_passes_on_moe_with_checkpoint_names(name: str, moe_engine: str, moe_trained, tmp_path: Path) -> None:
    from miles_contracts.wire.engine import decode_routed_experts
    from miles_weights.bench_models import load_tensors

    path, reference = moe_trained
    tensors = load_tensors(path, torch.float32, "cpu")  # checkpoint names, as FSDP's named weights give them
    assert any(".mlp.experts.3.up_proj.weight" in n for n, _ in tensors)
    with make(name, tmp_path, check=True) as transport:
        transport.push(iter(tensors), targets=[moe_engine], version=5)
    checksums = json.loads(urllib.request.urlopen(urllib.request.Request(moe_engine + "/weights_checksum", headers=auth_headers()), timeout=60).read())["checksums"]
    assert set(checksums) == {n for n, _ in tensors}

    prompt = [1, 504, 3458, 282, 4649]
    answer = _greedy(moe_engine, prompt, return_routed_experts=True)
    assert answer["output_ids"] == _reference_greedy(reference, prompt)
    tokens = prompt + answer["output_ids"]
    raw = decode_routed_experts(answer["meta_info"]["routed_experts"])
    layers, top_k = reference.config.num_hidden_layers, reference.config.num_experts_per_tok
    routed = np.frombuffer(raw, dtype="<i4").reshape(len(tokens) - 1, layers, top_k)
    np.testing.assert_array_equal(routed, router_top_k(reference, tokens[:-1]))


def test_fsdp_named_weights_are_the_names_the_moe_engine_reports(moe_engine: str, moe_trained) -> None:
    """What the FSDP trainer yields (transformers' reverse conversion) is what the engine takes and checks."""
    gather = pytest.importorskip("miles_fsdp.weights").gather_named_weights
    _, reference = moe_trained
    checksums = json.loads(urllib.request.urlopen(urllib.request.Request(moe_engine + "/weights_checksum", headers=auth_headers()), timeout=60).read())["checksums"]
    assert {name for name, _ in gather(reference)} == set(checksums)
