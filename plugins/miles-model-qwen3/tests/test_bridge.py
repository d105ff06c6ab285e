"""The Qwen3 / Qwen3-MoE bridge: conformance suite, transformers' packed experts, the claim, and a
real megatron-core GPTModel built on CPU (names, shapes and logits; see
``miles_contracts.testing.megatron`` for the three CPU patches)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from miles_contracts.testing.bridge import check_model_bridge, load_hf_checkpoint
from miles_model_llama import LOCAL, BridgeError, MegatronLayout
from miles_model_qwen3.bridge import Qwen3Bridge

LAYOUTS = {
    "transformer_engine": Qwen3Bridge(),
    "local": Qwen3Bridge(LOCAL),
    "grouped_gemm": Qwen3Bridge(MegatronLayout(grouped_gemm=True)),
}


def _save(folder: Path, config: Any) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def tiny_dense_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3 dense, untied, head_dim 16 != hidden / heads (8); large init so mistakes show in logits."""
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=256, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.3,
    )
    return _save(tmp_path_factory.mktemp("qwen3"), config)


@pytest.fixture(scope="module")
def tiny_moe_unnormalised(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-MoE without top-k renormalisation (megatron: pre-softmax routing), untied, large init."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False,
        max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.3,
    )
    return _save(tmp_path_factory.mktemp("qwen3moe"), config)


@pytest.mark.parametrize("bridge", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("model", ["tiny_moe", "tiny_dense_qwen3", "tiny_moe_unnormalised"])
def test_conformance_suite(bridge: Qwen3Bridge, model: str, request: pytest.FixtureRequest) -> None:
    report = check_model_bridge(bridge, request.getfixturevalue(model))
    assert report.unchecked == () and report.shape_checked == report.megatron_tensors > 0


def test_expert_names_follow_the_layout(tiny_moe) -> None:
    state, config = load_hf_checkpoint(tiny_moe)
    sequential = Qwen3Bridge().to_megatron(state, config)
    grouped = Qwen3Bridge(MegatronLayout(grouped_gemm=True)).to_megatron(state, config)
    fc1 = state["model.layers.1.mlp.experts.3.gate_proj.weight"], state["model.layers.1.mlp.experts.3.up_proj.weight"]
    for name, tensors in (
        ("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight", sequential),
        ("decoder.layers.1.mlp.experts.linear_fc1.weight3", grouped),
    ):
        assert torch.equal(tensors[name], torch.cat(fc1))
    assert torch.equal(sequential["decoder.layers.0.mlp.router.weight"], state["model.layers.0.mlp.gate.weight"])
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in sequential  # MoE layers keep their norm under TE


def test_live_model_state_with_packed_experts_converts_like_the_checkpoint(tiny_moe) -> None:
    from transformers import AutoModelForCausalLM

    state, config = load_hf_checkpoint(tiny_moe)
    live = AutoModelForCausalLM.from_pretrained(tiny_moe).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in live and "lm_head.weight" in live  # packed and tied
    bridge = Qwen3Bridge()
    from_live, from_disk = bridge.to_megatron(live, config), bridge.to_megatron(state, config)
    assert from_live.keys() == from_disk.keys()
    assert all(torch.equal(from_live[n], from_disk[n]) for n in from_disk)


def test_megatron_config_of_moe(tiny_moe, tiny_moe_unnormalised) -> None:
    config = json.loads((tiny_moe / "config.json").read_text())
    megatron = Qwen3Bridge().megatron_config(config)
    transformer = megatron["transformer_config"]
    assert transformer["qk_layernorm"] is True and transformer["kv_channels"] == 16
    assert (transformer["num_moe_experts"], transformer["moe_router_topk"], transformer["moe_ffn_hidden_size"]) == (4, 2, 32)
    assert transformer["moe_router_pre_softmax"] is False  # norm_topk_prob: true
    assert megatron["layer_spec"]["kwargs"] == {"num_experts": 4, "moe_grouped_gemm": False, "qk_layernorm": True}
    unnormalised = json.loads((tiny_moe_unnormalised / "config.json").read_text())
    assert Qwen3Bridge().megatron_config(unnormalised)["transformer_config"]["moe_router_pre_softmax"] is True


def test_dense_layers_inside_an_moe_model_are_refused_clearly(tiny_moe) -> None:
    config = {**json.loads((tiny_moe / "config.json").read_text()), "mlp_only_layers": [0]}
    with pytest.raises(BridgeError, match=r"mlp_only_layers=\[0\].*not supported yet"):
        Qwen3Bridge().megatron_config(config)


def test_kernel_hands_qwen3_checkpoints_to_this_plugin(tiny_moe, tiny_dense_qwen3) -> None:
    from miles.kernel import Kernel

    for folder in (tiny_moe, tiny_dense_qwen3):
        bridge = Kernel.load().model_bridge(json.loads((folder / "config.json").read_text()))
        assert isinstance(bridge, Qwen3Bridge) and bridge.chat_family == "qwen3"
    assert not Qwen3Bridge.claims({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})


# ----------------------------------------------------------------------------- megatron-core on CPU


@pytest.fixture(scope="module")
def megatron() -> Iterator[None]:
    from miles_contracts.testing.megatron import cpu_megatron

    with cpu_megatron():
        yield


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny_moe", "tiny_dense_qwen3", "tiny_moe_unnormalised"])
def test_megatron_model_matches_names_shapes_and_logits(megatron: None, model: str, request: pytest.FixtureRequest) -> None:
    from miles_contracts.testing.megatron import check_against_megatron

    report = check_against_megatron(Qwen3Bridge(LOCAL), request.getfixturevalue(model))
    # fp32 on CPU; a wrong q/k norm, head order or routing rule moves logits by > 0.1 here.
    assert report.max_logit_diff < 1e-3, report


def test_moe_layer_map_names_every_router(tiny_moe: Path, tiny_moe_unnormalised: Path, tiny_dense_qwen3: Path) -> None:
    from transformers import AutoModelForCausalLM

    def config(folder: Path) -> dict[str, Any]:
        return json.loads((folder / "config.json").read_text())

    layer_map = Qwen3Bridge().moe_layers(config(tiny_moe))
    assert (layer_map.num_layers, layer_map.moe_layers, layer_map.num_experts, layer_map.top_k) == (2, (0, 1), 4, 2)
    assert layer_map.scoring == "softmax" and layer_map.normalize_top_k
    model = AutoModelForCausalLM.from_pretrained(tiny_moe)
    routers = [model.get_submodule(layer_map.router_path(i)) for i in layer_map.moe_layers]
    assert [type(r).__name__ for r in routers] == ["Qwen3MoeTopKRouter"] * 2
    assert Qwen3Bridge().moe_layers(config(tiny_moe_unnormalised)).normalize_top_k is False
    assert Qwen3Bridge().moe_layers(config(tiny_dense_qwen3)) is None
