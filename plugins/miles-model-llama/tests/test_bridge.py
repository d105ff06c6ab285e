"""The llama bridge: conformance suite, the claim, and megatron_config for real configs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from miles_contracts.testing.bridge import check_model_bridge
from miles_model_llama import LOCAL, LlamaBridge, MegatronLayout

LAYOUTS = [LlamaBridge(), LlamaBridge(LOCAL)]


@pytest.mark.parametrize("bridge", LAYOUTS, ids=["transformer_engine", "local"])
@pytest.mark.parametrize("model", ["tiny_dense", "tiny_untied", "tiny_biased"])
def test_conformance_suite(bridge: LlamaBridge, model: str, request: pytest.FixtureRequest) -> None:
    report = check_model_bridge(bridge, request.getfixturevalue(model))
    assert report.unchecked == ()  # every megatron tensor's shape was checked against megatron_config
    assert report.shape_checked == report.megatron_tensors > 0


def test_kernel_hands_llama_checkpoints_to_this_plugin(tiny_dense) -> None:
    from miles.kernel import Kernel

    config = json.loads((tiny_dense / "config.json").read_text())
    bridge = Kernel.load().model_bridge(config)
    assert isinstance(bridge, LlamaBridge) and bridge.name == "llama"
    assert bridge.layout == MegatronLayout()  # the Transformer Engine spec by default


@pytest.mark.parametrize(
    ("config", "claimed"),
    [
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, True),
        ({"model_type": "llama"}, True),  # no architectures: model_type decides
        ({"architectures": ["LlamaForSequenceClassification"], "model_type": "llama"}, False),  # no lm_head
        ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, False),
        ({"architectures": ["MyLlamaLikeForCausalLM"], "model_type": "my-llama"}, False),  # no name substrings
    ],
)
def test_claim_is_decided_by_architecture(config: dict, claimed: bool) -> None:
    assert LlamaBridge.claims(config) is claimed


def test_megatron_config_of_smollm2() -> None:
    from miles_models import pull

    config = json.loads((pull("smollm2-135m-instruct", progress=False) / "config.json").read_text())
    megatron = LlamaBridge().megatron_config(config)
    transformer, model = megatron["transformer_config"], megatron["gpt_model"]
    assert (transformer["num_layers"], transformer["hidden_size"], transformer["ffn_hidden_size"]) == (30, 576, 1536)
    assert (transformer["num_attention_heads"], transformer["num_query_groups"], transformer["kv_channels"]) == (9, 3, 64)
    assert transformer["normalization"] == "RMSNorm" and transformer["gated_linear_unit"] is True
    assert transformer["activation_func"].__name__ == "silu" and transformer["add_bias_linear"] is False
    assert model == {
        "vocab_size": 49152, "max_sequence_length": 8192, "position_embedding_type": "rope", "rotary_base": 100000,
        "rotary_percent": 1.0, "share_embeddings_and_output_weights": True,
    }
    assert megatron["layer_spec"] == {
        "function": "get_gpt_layer_with_transformer_engine_spec",
        "kwargs": {"num_experts": None, "moe_grouped_gemm": False, "qk_layernorm": False},
    }


def test_llama3_rope_scaling_maps_to_megatron_rope_scaling(tiny_untied) -> None:
    config = json.loads((tiny_untied / "config.json").read_text())
    model = LlamaBridge().megatron_config(config)["gpt_model"]
    assert (model["rope_scaling"], model["rope_scaling_factor"], model["rotary_base"]) == (True, 8.0, 500000)


def test_plugin_module_imports_no_torch() -> None:
    # `miles plugins` imports every plugin module; this one must stay cheap.
    code = "import sys, miles_model_llama.plugin; print(sorted(m for m in ('torch', 'transformers', 'megatron') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
