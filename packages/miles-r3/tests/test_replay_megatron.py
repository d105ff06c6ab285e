"""Routing replay in a real megatron-core ``GPTModel`` (0.16, CPU, world size 1): the tiny Qwen3-MoE
converted by its bridge, its routers perturbed, the HF model's routing replayed through the
``miles_forward`` wrapper. What each ``TopKRouter`` hands the token dispatcher is watched with a
forward hook, independently of the replay."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from miles.context import context_for  # noqa: E402
from miles_contracts import ForwardContext, MoeLayerMap, Process, TrainBatch  # noqa: E402
from miles_contracts.testing.bridge import load_hf_checkpoint  # noqa: E402
from miles_contracts.testing.megatron import build_gpt_model, cpu_megatron, megatron_logits  # noqa: E402
from miles_model_llama import LOCAL  # noqa: E402
from miles_model_qwen3.bridge import Qwen3Bridge  # noqa: E402
from miles_models.testing import router_top_k  # noqa: E402
from miles_r3 import plugin as r3  # noqa: E402
from miles_r3.config import R3Section  # noqa: E402
from miles_r3.experts import ROUTED_EXPERTS  # noqa: E402


def recorded_batch(tokens: torch.Tensor, hf_model: torch.nn.Module, moe_map: MoeLayerMap) -> TrainBatch:
    """A batch of ``tokens [B, T]`` carrying the HF model's routing as the rollout's (each row's last
    position unrecorded, as a rollout leaves it)."""
    b, t = tokens.shape
    table = np.full((b, t, len(moe_map.moe_layers), moe_map.top_k), moe_map.num_experts, dtype=np.uint8)
    for row in range(b):
        table[row, : t - 1] = router_top_k(hf_model, tokens[row].tolist())[: t - 1]
    zeros = torch.zeros(b, t)
    return TrainBatch(tokens=tokens, attention_mask=torch.ones(b, t, dtype=torch.long), loss_mask=zeros,
                      rollout_logprobs=zeros, rewards=torch.zeros(b), group_ids=torch.zeros(b, dtype=torch.long),
                      rollout_ids=torch.arange(b), extras={ROUTED_EXPERTS.name: torch.from_numpy(table)})


def sequence_major_positions(b: int, t: int) -> torch.Tensor:
    """megatron-core's routers see ``[s, b]`` flattened: token ``(s, row)`` is batch entry ``row * t + s``."""
    return (torch.arange(b)[None, :] * t + torch.arange(t)[:, None]).reshape(-1)


def test_megatron_routers_replay_the_recorded_experts(tiny_moe: Path, moe_map: MoeLayerMap) -> None:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32, attn_implementation="eager").eval()
    tokens = torch.randint(0, hf_model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = recorded_batch(tokens, hf_model, moe_map)
    with torch.no_grad():
        reference = hf_model(tokens).logits
    kernel = context_for(process=Process.trainer_rank(0)).kernel  # a rank's kernel: the r3 wrapper in it
    saved = r3.STATE._settings
    with cpu_megatron():
        hf_state, hf_config = load_hf_checkpoint(tiny_moe)
        bridge = Qwen3Bridge(LOCAL)
        model = build_gpt_model(bridge.megatron_config(hf_config)).eval()
        model.load_state_dict(bridge.to_megatron(hf_state, hf_config), strict=False)
        routers = [m for name, m in model.named_modules() if name.endswith("mlp.router")]
        used: list[torch.Tensor] = []
        for router in routers:
            router.register_forward_hook(lambda module, args, output: used.append(output[1].nonzero()[:, 1].reshape(-1, 2)))

        def run(replay: bool) -> tuple[float, float]:
            r3.STATE.settings = R3Section(enabled=True, replay=replay)
            used.clear()
            ctx = ForwardContext(phase="old_logprobs", model=model, batch=batch, backend="megatron", bridge=bridge,
                                 state={"token_positions": lambda: sequence_major_positions(*tokens.shape)})
            logits = kernel.run_forward(ctx, lambda: megatron_logits(model, tokens))
            return _agreement(used, batch), float((logits - reference).abs().mean())

        try:
            agree_clean, diff_clean = run(replay=True)
            r3.STATE.stats.flush()
            with torch.no_grad():
                for router in routers:
                    router.weight.add_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(1)) * router.weight.std())
            agree_off, diff_off = run(replay=False)
            stats_off = r3.STATE.stats.flush()
            agree_on, diff_on = run(replay=True)
        finally:
            r3.STATE.settings = saved
    assert agree_clean == 1.0 and diff_clean < 1e-4  # replaying the model's own routing changes nothing
    assert agree_off < 0.8 and stats_off["r3/old_logprobs/routing_agreement"] == pytest.approx(agree_off)
    assert agree_on == 1.0  # every recorded token of every MoE layer
    assert diff_on < 0.5 * diff_off  # mean |logit| gap to the unperturbed HF model


def _agreement(used: list[torch.Tensor], batch: TrainBatch) -> float:
    """Share of recorded (token, layer) pairs whose experts the dispatcher got equal the recorded ones."""
    table = batch.extra(ROUTED_EXPERTS)
    b, t, _, k = table.shape
    order = sequence_major_positions(b, t)
    recorded = table.reshape(b * t, -1, k)[order]
    mask = recorded[:, 0, 0] < 4
    same = sum(int((got.sort(-1).values[mask] == recorded[:, column].long().sort(-1).values[mask]).all(-1).sum())
               for column, got in enumerate(used))
    return same / (int(mask.sum()) * len(used))


def test_the_megatron_backend_gives_replay_its_token_positions(tiny_moe: Path, moe_map: MoeLayerMap) -> None:
    """Through ``MegatronBackend`` (packed rows, the backend's own ForwardContext): every recorded
    token is replayed, and replaying the routing of the model the backend loaded (the same weights)
    agrees with the trainer's own choice everywhere."""
    from miles_megatron.backend import MegatronBackend
    from miles_megatron.testing import config_for
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32, attn_implementation="eager").eval()
    lengths = (12, 9)
    tokens = torch.randint(0, hf_model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = recorded_batch(tokens, hf_model, moe_map)
    table = batch.extra(ROUTED_EXPERTS).clone()
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, lengths[1]:] = 0
    table[1, lengths[1] - 1:] = moe_map.num_experts  # a shorter row: its padding and last token unrecorded
    table[1, : lengths[1] - 1] = torch.from_numpy(router_top_k(hf_model, tokens[1, : lengths[1]].tolist())[: lengths[1] - 1])
    loss_mask = mask.float()
    loss_mask[:, 0] = 0  # the first token is the prompt
    batch = TrainBatch(tokens=tokens, attention_mask=mask, loss_mask=loss_mask, rollout_logprobs=torch.zeros(2, 12),
                       rewards=torch.zeros(2), group_ids=torch.zeros(2, dtype=torch.long), rollout_ids=torch.arange(2),
                       extras={ROUTED_EXPERTS.name: table})
    saved = r3.STATE._settings
    backend = MegatronBackend(context_for(config_for(tiny_moe, micro_batch_tokens=64), Process.trainer_rank(0)))
    try:
        r3.STATE.settings = R3Section(enabled=True, replay=True)
        r3.STATE.stats.flush()
        backend.compute_logprobs(batch)
        stats = r3.STATE.stats.flush()
    finally:
        r3.STATE.settings = saved
        backend.close()
    assert stats["r3/old_logprobs/replayed_tokens"] == sum(n - 1 for n in lengths)
    assert stats["r3/old_logprobs/routing_agreement"] == pytest.approx(1.0)
