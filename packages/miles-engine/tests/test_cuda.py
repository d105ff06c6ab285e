"""The engine on CUDA (bf16): generation, logprobs against teacher forcing, a CUDA IPC weight
update. Skipped without a GPU (root conftest)."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib

import pytest
import torch
from engine_support import serve_engine
from miles_contracts.wire.tensors import serialize_cuda_ipc
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


def test_cuda_ipc_weight_update(cuda_engine):
    trained = AutoModelForCausalLM.from_pretrained(tiny_model("dense", seed=1), dtype=torch.bfloat16).cuda()
    payload = serialize_cuda_ipc(trained.state_dict().items())
    answer = cuda_engine.post("/update_weights_from_tensor", {"serialized_named_tensors": [payload],
                                                              "load_format": "cuda_ipc", "weight_version": "ipc-1"})
    assert answer.status_code == 200, answer.text
    torch.cuda.synchronize()
    sums = cuda_engine.get("/weights_checksum").json()
    assert sums["weight_version"] == "ipc-1"
    name = "model.layers.0.self_attn.q_proj.weight"
    raw = trained.state_dict()[name].contiguous().view(-1).view(torch.uint8).cpu().numpy()
    assert sums["checksums"][name] == hashlib.sha256(raw).hexdigest()
