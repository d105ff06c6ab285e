"""Weight updates on a real server: disk, flattened_shm, a gloo broadcast group; versions,
checksums, noise, and updates that must be refused without changing anything.

The engine serves the tiny random Llama of seed 0; the "trained" weights are the same
architecture with seed 1. Bit-exactness is checked with SHA-256 of each tensor's raw bytes.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from engine_support import free_port, serve_engine
from miles_contracts.wire.distributed import create_weight_group, destroy_weight_group
from miles_contracts.wire.tensors import write_shm_bucket
from miles_models.testing import tiny_model
from transformers import AutoModelForCausalLM

PROMPT = [1, 504, 3458, 282]


def sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


@pytest.fixture(scope="module")
def trained_path():
    return tiny_model("dense", seed=1)


@pytest.fixture(scope="module")
def trained(trained_path):
    return AutoModelForCausalLM.from_pretrained(trained_path, dtype=torch.float32).eval()


@pytest.fixture
def engine(dense_path, tmp_path_factory):
    # disk updates may read the tiny-model cache and this session's temporary folders
    allowed = [str(Path(dense_path).parent), str(tmp_path_factory.getbasetemp())]
    with serve_engine(dense_path, weight_dir=allowed) as running:
        yield running


def push_shm(engine, named, *, version: str | None = None):
    """POST ``named`` tensors as one ``flattened_shm`` bucket; returns the HTTP answer."""
    bucket = write_shm_bucket(named)
    body = {"serialized_named_tensors": [json.dumps(bucket.to_json())], "load_format": "flattened_shm"}
    if version is not None:
        body["weight_version"] = version
    try:
        return engine.post("/update_weights_from_tensor", body)
    finally:
        os.unlink(bucket.path)


def checksums(engine) -> dict[str, str]:
    return engine.get("/weights_checksum").json()["checksums"]


def greedy(engine) -> dict:
    return engine.generate({"input_ids": PROMPT, "return_logprob": True,
                            "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}})


def logprobs(answer: dict) -> list[float]:
    return [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]


def reference_greedy(model) -> list[int]:
    """Greedy decoding by full forwards (no cache, no EOS handling)."""
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT):]


def stored_once(model) -> dict[str, torch.Tensor]:
    """The model's state_dict with each storage once: a tied ``lm_head.weight`` is the embedding's
    bytes, which the engine reports under the embedding's name only."""
    out, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            out[name] = tensor
    return out


def assert_holds(engine, model) -> None:
    expected = {name: sha256(t) for name, t in stored_once(model).items()}
    held = checksums(engine)
    assert set(held) == set(expected)
    assert held == expected
    assert greedy(engine)["output_ids"] == reference_greedy(model)


def test_update_from_disk_loads_the_folder_and_sets_the_version_it_names(engine, trained_path, trained):
    before = greedy(engine)
    answer = engine.post("/update_weights_from_disk", {"model_path": str(trained_path), "weight_version": "1"})
    assert answer.status_code == 200 and answer.json()["success"], answer.text
    assert_holds(engine, trained)
    after = greedy(engine)
    assert after["meta_info"]["weight_version"] == "1"
    assert logprobs(after) != logprobs(before)
    assert engine.get("/get_model_info").json()["weight_version"] == "1"


def test_update_from_flattened_shm(engine, trained):
    answer = push_shm(engine, trained.state_dict().items(), version="step-3")
    assert answer.status_code == 200, answer.text
    assert_holds(engine, trained)
    assert greedy(engine)["meta_info"]["weight_version"] == "step-3"


def test_a_join_where_nobody_listens_fails_within_seconds_naming_the_address(engine):
    """The group timeout is 300 s (the default); a join to a port where no trainer hosts the store
    fails long before that (the client's own timeout is 120 s) and says where it looked."""
    port = free_port()
    answer = engine.post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                        "rank_offset": 1, "world_size": 2, "backend": "gloo"})
    assert answer.status_code == 400, answer.text
    assert f"nothing accepts connections at 127.0.0.1:{port}" in answer.json()["message"]
    assert engine.get("/health").status_code == 200


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_update_from_distributed_over_gloo(engine, trained, load_format):
    """The trainer is rank 0 in this test process; the engine joins as rank 1 over HTTP. Per tensor
    (one broadcast each) or flattened (one broadcast of every tensor's bytes back to back)."""
    port = free_port()
    names = list(trained.state_dict())
    tensors = [trained.state_dict()[n].contiguous() for n in names]
    with cf.ThreadPoolExecutor(1) as pool:
        joined = pool.submit(engine.post, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "test_group", "backend": "gloo"})
        group = create_weight_group("gloo", "127.0.0.1", port, 0, 2, "test_group")
        assert joined.result().json()["success"], joined.result().text
        try:
            update = pool.submit(engine.post, "/update_weights_from_distributed", {
                "names": names, "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
                "shapes": [list(t.shape) for t in tensors], "group_name": "test_group", "weight_version": "9",
                "load_format": load_format})
            if load_format is None:
                for tensor in tensors:
                    torch.distributed.broadcast(tensor, src=0, group=group)
            else:
                torch.distributed.broadcast(torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]), src=0,
                                            group=group)
            answer = update.result()
        finally:
            destroy_weight_group(group)
    assert answer.status_code == 200 and answer.json()["success"], answer.text
    assert_holds(engine, trained)
    assert greedy(engine)["meta_info"]["weight_version"] == "9"
    assert engine.post("/destroy_weights_update_group", {"group_name": "test_group"}).json()["success"]


def test_noise_then_restore_is_bit_exact(engine, dense_path):
    original = checksums(engine)
    before = greedy(engine)
    assert engine.post("/fill_weights_noise", {"seed": 5}).json()["success"]
    noisy = checksums(engine)
    assert all(noisy[name] != digest for name, digest in original.items())
    assert logprobs(greedy(engine)) != logprobs(before)
    assert engine.post("/update_weights_from_disk", {"model_path": str(dense_path)}).json()["success"]
    assert checksums(engine) == original
    restored = greedy(engine)
    assert restored["output_ids"] == before["output_ids"] and logprobs(restored) == logprobs(before)


def test_update_weight_version(engine):
    assert engine.post("/update_weight_version", {"new_version": "v7"}).json()["success"]
    assert greedy(engine)["meta_info"]["weight_version"] == "v7"
    assert engine.get("/weights_checksum").json()["weight_version"] == "v7"
    engine.post("/update_weight_version", {"new_version": "41"})
    engine.post("/fill_weights_noise", {"seed": 1})
    assert engine.get("/get_model_info").json()["weight_version"] == "41"  # noise is not a version


def test_bad_updates_are_refused_and_change_nothing(engine, trained, tmp_path):
    original = checksums(engine)
    state = trained.state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    cases = [
        [(name, state[name][:, :8].contiguous())],  # wrong shape
        [("model.layers.0.not_a_weight", state[name]), (name, state[name])],  # unknown name
    ]
    for tensors in cases:
        bucket = write_shm_bucket(tensors)
        try:
            answer = engine.post("/update_weights_from_tensor", {
                "serialized_named_tensors": [json.dumps(bucket.to_json())], "load_format": "flattened_shm"})
        finally:
            os.unlink(bucket.path)
        assert answer.status_code == 400 and answer.json()["success"] is False
        assert "nothing was loaded" in answer.json()["message"]
    missing = engine.post("/update_weights_from_disk", {"model_path": str(tmp_path / "nope")})
    assert missing.status_code == 400 and "not a folder" in missing.json()["message"]
    empty = engine.post("/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert empty.status_code == 400 and "no *.safetensors" in empty.json()["message"]
    nccl = engine.post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": free_port(),
                                                      "rank_offset": 1, "world_size": 2, "backend": "nccl"})
    assert nccl.status_code == 400 and "gloo" in nccl.json()["message"]
    no_group = engine.post("/update_weights_from_distributed", {"names": [name], "dtypes": ["float32"], "shapes": [[64, 64]]})
    assert no_group.status_code == 400 and "init_weights_update_group" in no_group.json()["message"]
    bad_layout = engine.post("/update_weights_from_distributed", {"names": [name], "dtypes": ["float32"],
                                                                  "shapes": [[64, 64]], "load_format": "npz"})
    assert bad_layout.status_code == 400
    assert "load_format 'npz'" in bad_layout.json()["message"] and "flattened_bucket" in bad_layout.json()["message"]
    bad_format = engine.post("/update_weights_from_tensor", {"serialized_named_tensors": ["x"], "load_format": "npz"})
    assert bad_format.status_code == 400
    assert checksums(engine) == original
    assert engine.get("/get_model_info").json()["weight_version"] == "0"
    assert greedy(engine)["meta_info"]["finish_reason"]["type"] == "length"


def test_the_tied_head_follows_an_update_of_the_embedding_alone(engine, trained):
    """A checkpoint of a tied model stores the embedding only; the engine's head must follow it."""
    name = "model.embed_tokens.weight"
    answer = push_shm(engine, [(name, trained.state_dict()[name])])
    assert answer.status_code == 200, answer.text
    model = engine.engine.loaded.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, trained.lm_head.weight)
    held = checksums(engine)
    assert "lm_head.weight" not in held and held[name] == sha256(trained.state_dict()[name])


def test_an_update_may_name_the_tied_alias(engine, trained):
    answer = push_shm(engine, [("lm_head.weight", trained.lm_head.weight.detach())])
    assert answer.status_code == 200, answer.text
    assert checksums(engine)["model.embed_tokens.weight"] == sha256(trained.model.embed_tokens.weight)


@pytest.fixture(scope="module")
def moe_trained():
    path = tiny_model("moe", seed=1)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture
def moe_engine(moe_path):
    with serve_engine(moe_path) as running:
        yield running


def test_moe_tensor_updates_take_checkpoint_names(moe_engine, moe_trained):
    """The checkpoint's per-expert tensors land in transformers' fused expert parameters; the
    checksums are reported under the same checkpoint names."""
    from safetensors.torch import load_file

    path, model = moe_trained
    ckpt = load_file(str(path / "model.safetensors"))
    assert "model.layers.1.mlp.experts.2.gate_proj.weight" in ckpt
    assert engine_state_differs(moe_engine, model)
    answer = push_shm(moe_engine, sorted(ckpt.items()))
    assert answer.status_code == 200, answer.text
    assert checksums(moe_engine) == {name: sha256(t) for name, t in ckpt.items()}
    assert not engine_state_differs(moe_engine, model)
    assert greedy(moe_engine)["output_ids"] == reference_greedy(model)


def test_moe_tensor_updates_also_take_the_fused_runtime_names(moe_engine, moe_trained):
    _, model = moe_trained
    name = "model.layers.0.mlp.experts.gate_up_proj"
    fused = model.state_dict()[name]
    answer = push_shm(moe_engine, [(name, fused)])
    assert answer.status_code == 200, answer.text
    assert torch.equal(moe_engine.engine.loaded.model.state_dict()[name], fused)
    half = fused.shape[1] // 2
    assert checksums(moe_engine)["model.layers.0.mlp.experts.3.up_proj.weight"] == sha256(fused[3, half:])


def engine_state_differs(engine, model) -> bool:
    held = engine.engine.loaded.model.state_dict()
    return any(not torch.equal(held[n], t) for n, t in model.state_dict().items())
