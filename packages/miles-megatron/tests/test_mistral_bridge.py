"""A third party's bridge trains too: the Mistral bridge of the plugin tutorial
(``docs/plugins/example-bridge``), registered on a kernel, on a tiny random Mistral checkpoint."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from miles_contracts.testing.backend import make_test_batch, plain_logprobs

EXAMPLE = Path(__file__).resolve().parents[3] / "docs" / "plugins" / "example-bridge"


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory, tiny_dense) -> Path:
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_dense)
    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=None,
                           tie_word_embeddings=False, max_position_embeddings=512)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("mistral")
    MistralForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def test_mistral_bridge_scores_and_trains(tiny_mistral, backend_factory, monkeypatch) -> None:
    from miles.kernel import Kernel
    from miles.plugins import PluginSelection, load_plugins

    monkeypatch.syspath_prepend(str(EXAMPLE / "src"))
    from acme_miles import plugin

    selection = PluginSelection.from_settings(None, ())
    kernel = Kernel(load_plugins(selection), selection)
    kernel.register_plugin(plugin, name="acme")  # the bridge exists in this kernel only: the backend must use it
    backend = backend_factory(tiny_mistral, kernel=kernel)
    assert backend.bridge.name == "mistral"
    batch = make_test_batch(tiny_mistral)
    before = backend.compute_logprobs(batch)
    torch.testing.assert_close(before, plain_logprobs(tiny_mistral, batch), rtol=0, atol=1e-4)
    advantages = torch.where(batch.loss_mask > 0, torch.ones_like(before), torch.zeros_like(before))
    backend.train_step(replace(batch, advantages=advantages, rollout_logprobs=before))
    after = backend.compute_logprobs(batch)
    mask = batch.loss_mask > 0
    assert float(after[mask].mean()) > float(before[mask].mean())
    assert {n for n, _ in backend.named_weights()} >= {"lm_head.weight", "model.embed_tokens.weight"}
