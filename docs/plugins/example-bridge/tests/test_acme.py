"""Tests of the acme plugin. They run without installing it: the plugin module is registered into
a kernel that has only Miles' essential plugin loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from acme_miles import plugin
from acme_miles.bridge import MistralBridge
from acme_miles.reward import ConciseReward, ConciseSection
from miles.config import MilesConfig
from miles.context import context_for
from miles.kernel import Kernel
from miles.plugins import PluginSelection
from miles_contracts.testing.bridge import check_model_bridge
from miles_contracts.testing.reward import check_reward
from miles_model_llama import BridgeError
from pydantic import ValidationError


@pytest.fixture
def kernel():
    kernel = Kernel.load(PluginSelection(enable=("core",)))
    kernel.register_plugin(plugin, name="acme")
    yield kernel
    kernel.unregister_plugin("acme")


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM, MistralConfig

    config = MistralConfig(
        vocab_size=256, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, sliding_window=None,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("mistral")
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def test_bridge_passes_the_conformance_suite(tiny_mistral: Path) -> None:
    report = check_model_bridge(MistralBridge(), tiny_mistral)
    assert report.shape_checked == report.megatron_tensors


def test_kernel_hands_mistral_checkpoints_to_acme(kernel: Kernel, tiny_mistral: Path) -> None:
    config = json.loads((tiny_mistral / "config.json").read_text())
    assert kernel.model_bridge(config).name == "mistral"


def test_sliding_window_models_are_refused_with_the_reason(tiny_mistral: Path) -> None:
    config = {**json.loads((tiny_mistral / "config.json").read_text()), "sliding_window": 4096}
    with pytest.raises(BridgeError, match="sliding_window=4096"):
        MistralBridge().megatron_config(config)


def test_reward_passes_the_conformance_suite() -> None:
    check_reward(ConciseReward(max_words=3))


def test_reward_and_config_section_are_registered(kernel: Kernel) -> None:
    assert kernel.rewards().get("concise") is plugin.CONCISE
    assert kernel.config_sections().get("concise").model is ConciseSection
    with pytest.raises(ValidationError):
        ConciseSection(max_words=0)


def test_a_run_scores_with_its_own_section(kernel: Kernel) -> None:
    config = MilesConfig(extra={"concise": ConciseSection(max_words=7)})
    reward = plugin.CONCISE.bind(context_for(config, kernel=kernel))
    assert reward == ConciseReward(max_words=7)
