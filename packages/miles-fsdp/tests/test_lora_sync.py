"""Adapter-only weight sync: a LoRA-trained fsdp backend pushes its adapters through a real transport
to a real ``miles serve engine`` process serving the same base with adapters attached; the engine
then generates what the merged model computes, and check mode works on the adapters."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import replace

import pytest
import torch
from miles.config import MilesConfig
from miles.context import context_for
from miles.sections import WeightsSection
from miles_contracts import LoRASpec, Process
from miles_contracts.testing.backend import make_test_batch
from miles_contracts.testing.transport import check_weight_transport
from miles_contracts.wire.auth import auth_headers
from miles_weights.launch import EngineLaunch, running_engines

pytestmark = pytest.mark.slow
LORA = LoRASpec(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def _call(url: str, path: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json", **auth_headers()}
    with urllib.request.urlopen(urllib.request.Request(url + path, data=data, headers=headers), timeout=60) as answer:
        return json.loads(answer.read())


def _shared_memory(check: bool):
    config = MilesConfig(weights=WeightsSection(transport="shared_memory", check=check))
    ctx = context_for(config, Process.trainer_rank(0))
    return ctx.kernel.weight_transports().get("shared_memory").create(ctx)


def _merged_logprobs(merged_dir, ids: list[int]) -> tuple[list[int], list[float]]:
    """Greedy next tokens and their log-probs of the merged checkpoint, teacher-forced on ``ids``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, len(PROMPT) - 1:-1].float()
    logp = torch.log_softmax(logits, -1)
    out = torch.tensor(ids[len(PROMPT):])
    return logits.argmax(-1).tolist(), logp.gather(1, out[:, None]).squeeze(1).tolist()


def test_adapters_reach_the_engine_which_then_equals_the_merged_model(tiny_dense, backend_factory, tmp_path) -> None:
    backend = backend_factory(tiny_dense, lora=LORA, lr=5e-2, micro_batch_tokens=32)
    batch = make_test_batch(tiny_dense)
    batch = replace(batch, advantages=batch.loss_mask.clone(), old_logprobs=backend.compute_logprobs(batch))
    for _ in range(2):
        backend.train_step(batch)
    adapters = list(backend.named_weights())
    assert adapters and all(".lora_" in name for name, _ in adapters)
    backend.export_hf(tmp_path / "merged")

    launch = EngineLaunch("cpu", "float32", lora=LORA.model_dump())
    with running_engines(tiny_dense, [launch], tmp_path / "engines") as engines, \
            _shared_memory(check=True) as checked, _shared_memory(check=False) as plain:
        url = engines.urls[0]
        # check mode on adapters: noise on the adapters only, restored bit-exactly by the sync
        check_weight_transport(plain, url, adapters, version=3)
        report = checked.push(iter(adapters), targets=[url], version=7)
        assert report.num_tensors == len(adapters) == 4 * 2 * 2
        assert report.num_bytes == sum(t.numel() * 4 for _, t in adapters)
        assert str(_call(url, "/get_model_info")["weight_version"]) == "7"  # one sync, one version

        answer = _call(url, "/generate", {"input_ids": PROMPT, "return_logprob": True,
                                          "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}})
    greedy, logprobs = _merged_logprobs(tmp_path / "merged", PROMPT + answer["output_ids"])
    assert answer["output_ids"] == greedy
    served = [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]
    torch.testing.assert_close(torch.tensor(served), torch.tensor(logprobs), rtol=0, atol=1e-4)
