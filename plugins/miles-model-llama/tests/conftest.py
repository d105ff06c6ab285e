"""Tiny random Llama checkpoints with the features the bridge must handle, written as real files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
}


def save_tiny_llama(folder: Path, **overrides: Any) -> Path:
    """A 2-layer random ``LlamaForCausalLM`` (vocab 256) saved as safetensors + config.json."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    settings: dict[str, Any] = dict(
        vocab_size=256, hidden_size=48, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, max_position_embeddings=512, tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        initializer_range=0.3,  # peaky attention, so a wrong rope or head order moves logits by > 0.1
    )
    settings.update(overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**settings), dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="session")
def tiny_untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Untied output layer, 6 heads in 2 groups, head_dim (16) != hidden / heads (8), Llama 3.1 rope."""
    return save_tiny_llama(tmp_path_factory.mktemp("untied"), rope_parameters=LLAMA3_ROPE)


@pytest.fixture(scope="session")
def tiny_biased(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Attention and MLP biases, plain multi-head attention (as many key/value heads as heads)."""
    return save_tiny_llama(
        tmp_path_factory.mktemp("biased"), num_key_value_heads=6, head_dim=8, attention_bias=True, mlp_bias=True,
    )
