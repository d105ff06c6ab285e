"""The engine on CUDA (bf16): generation, logprobs against teacher forcing, a CUDA IPC weight
update. Skipped without a GPU (root conftest)."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import subprocess
import sys

import pytest
import torch
from engine_support import serve_engine
from miles_models.testing import tiny_model
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.gpu
PROMPT = [1, 504, 3458, 282, 4649, 314]


@pytest.fixture(scope="module")
def cuda_engine(dense_path):
    with serve_engine(dense_path, device="cuda") as running:
        yield running


def test_cuda_engine_runs_bf16_and_batches(cuda_engine):
    info = cuda_engine.get("/get_model_info").json()
    assert info["device"].startswith("cuda") and info["dtype"] == "bfloat16"
    bodies = [{"input_ids": [1, 10 + i], "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}} for i in range(8)]
    with cf.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(cuda_engine.generate, bodies))
    assert all(len(o["output_ids"]) == 16 for o in outs)
    seeded = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 3}}
    assert cuda_engine.generate(seeded)["output_ids"] == cuda_engine.generate(seeded)["output_ids"]


def test_cuda_logprobs_match_a_bf16_teacher_forced_forward(cuda_engine, dense_path):
    model = AutoModelForCausalLM.from_pretrained(dense_path, dtype=torch.bfloat16).cuda().eval()
    out = cuda_engine.generate({"input_ids": PROMPT, "return_logprob": True,
                                "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}})
    ids = torch.tensor([PROMPT + out["output_ids"]], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1].float()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(out["output_ids"], device="cuda")[:, None])[:, 0]
    returned = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]], device="cuda")
    worst = (returned - expected).abs().max().item()
    print(f"\nCUDA bf16 max |engine - teacher forced| logprob: {worst:.3e}")
    assert worst < 0.1  # bf16 KV cache vs one bf16 forward (feasibility-cpu.md §5: up to ~0.35 for 135M)


_PRODUCER = """
import sys, httpx, torch
from miles_contracts.wire.auth import auth_headers
from miles_contracts.wire.tensors import serialize_cuda_ipc
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.bfloat16).cuda()
body = {"serialized_named_tensors": [serialize_cuda_ipc(model.state_dict().items())], "load_format": "cuda_ipc",
        "weight_version": "ipc-1"}
answer = httpx.post(sys.argv[1] + "/update_weights_from_tensor", json=body, timeout=120, headers=auth_headers())
print(answer.status_code, answer.text)
"""


def test_cuda_ipc_weight_update(cuda_engine):
    # CUDA cannot open an IPC handle in the process that made it: the trainer is another process.
    trained_path = tiny_model("dense", seed=1)
    producer = subprocess.run([sys.executable, "-c", _PRODUCER, cuda_engine.url, str(trained_path)],
                              capture_output=True, text=True, timeout=300)
    assert producer.returncode == 0 and producer.stdout.startswith("200"), producer.stdout + producer.stderr
    sums = cuda_engine.get("/weights_checksum").json()
    assert sums["weight_version"] == "ipc-1"
    trained = AutoModelForCausalLM.from_pretrained(trained_path, dtype=torch.bfloat16)
    name = "model.layers.0.self_attn.q_proj.weight"
    raw = trained.state_dict()[name].contiguous().view(-1).view(torch.uint8).numpy()
    assert sums["checksums"][name] == hashlib.sha256(raw).hexdigest()


def test_released_memory_goes_back_to_the_gpu_and_comes_back_intact(cuda_engine):
    """Colocated runs: weights, KV cache and graphs leave the GPU while the trainer trains, and the
    engine serves the same weights (bit for bit) once resumed, with its KV cache at the capacity it had."""
    greedy = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}}
    before = cuda_engine.generate(greedy)["output_ids"]
    sums = cuda_engine.get("/weights_checksum").json()["checksums"]
    cache = cuda_engine.engine.scheduler.runner.cache
    capacity = (cache.slots, cache.length)
    assert capacity[0] > 0 and cache.keep_allocation  # kept between requests: decode graphs hold it
    held = torch.cuda.memory_allocated()
    cuda_engine.post("/pause_generation", {"mode": "abort"})
    assert cuda_engine.post("/release_memory_occupation", {}).status_code == 200
    freed = held - torch.cuda.memory_allocated()
    weights = sum(p.numel() * p.element_size() for p in cuda_engine.engine.loaded.model.parameters())
    assert cuda_engine.info()["memory_released"] == ["cuda_graph", "kv_cache", "weights"]
    assert freed >= weights  # at least the weights left the GPU (the KV cache too, when allocated)
    assert cuda_engine.post("/resume_memory_occupation", {}).status_code == 200
    assert (cache.slots, cache.length) == capacity and cache.k is not None  # back as it was, not regrown
    cuda_engine.post("/continue_generation", {})
    assert cuda_engine.get("/weights_checksum").json()["checksums"] == sums
    assert cuda_engine.generate(greedy)["output_ids"] == before
