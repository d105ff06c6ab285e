"""The engine's weight store in process (no server): which names it takes and reports, ties kept
by copying when they share no storage, the fused MoE layout and its check, and the noise."""

from __future__ import annotations

import pytest
import torch
from miles_engine import weights
from miles_engine.weights import WeightStore, WeightUpdateError, noise_generator
from miles_models.testing import tiny_model
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="module")
def dense_path_seed1():
    return tiny_model("dense", seed=1)


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_each_storage_is_reported_once_under_its_checkpoint_name(dense_path):
    model = load(dense_path)
    store = WeightStore(model)
    assert store.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in store.checksums() and "lm_head.weight" in store.targets
    assert len(store.checksums()) == len(model.state_dict()) - 1


def test_a_declared_tie_without_shared_storage_is_kept_by_copying(dense_path, dense_path_seed1):
    """A head the config ties but that holds its own copy (as after an untying load or a device
    move that duplicated it) must still equal the embedding after every update and noise fill."""
    model = load(dense_path)
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone(), requires_grad=False)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    store = WeightStore(model)
    assert store.aliases == {"lm_head.weight": "model.embed_tokens.weight"} and "lm_head.weight" not in store.checksums()
    store.fill_noise(3)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    trained = load(dense_path_seed1).model.embed_tokens.weight.detach()
    store.load_checked([("model.embed_tokens.weight", trained)])
    assert torch.equal(model.lm_head.weight, trained)
    store.load_checked([("lm_head.weight", trained * 2)])  # through the alias name too
    assert torch.equal(model.lm_head.weight, trained * 2) and torch.equal(model.model.embed_tokens.weight, trained * 2)


def test_the_fused_expert_layout_is_checked_against_transformers(moe_path, monkeypatch):
    """If transformers' own reverse conversion disagrees with the known layout (here: gate and up
    swapped), the checkpoint names are not offered; updates must use runtime names or disk."""
    model = load(moe_path)
    good = WeightStore(model)
    assert "model.layers.0.mlp.experts.1.up_proj.weight" in good.checksums()
    monkeypatch.setitem(weights.FUSED_EXPERTS, "gate_up_proj", ("up_proj", "gate_proj"))
    swapped = WeightStore(model)
    assert "model.layers.0.mlp.experts.gate_up_proj" in swapped.checksums()
    assert "model.layers.0.mlp.experts.1.up_proj.weight" not in swapped.targets
    with pytest.raises(WeightUpdateError, match="unknown tensor name"):
        swapped.check([("model.layers.0.mlp.experts.1.up_proj.weight", (32, 64))])


def test_expert_views_write_into_the_fused_parameter(moe_path):
    model = load(moe_path)
    store = WeightStore(model)
    fused = model.model.layers[1].mlp.experts.gate_up_proj
    half = fused.shape[1] // 2
    store.load_checked([("model.layers.1.mlp.experts.2.up_proj.weight", torch.full((half, fused.shape[2]), 7.0))])
    assert (fused[2, half:] == 7).all() and not (fused[2, :half] == 7).any()


def test_noise_is_not_a_plain_seeded_draw():
    """Noise from seed s must not equal ``randn`` from ``manual_seed(s)``: random test and
    benchmark models are drawn that way, and check mode could not tell them from noise."""
    shape = (16, 16)
    plain = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    salted = torch.randn(shape, generator=noise_generator(0))
    assert not torch.equal(plain, salted)
    assert torch.equal(salted, torch.randn(shape, generator=noise_generator(0)))  # still deterministic


@pytest.mark.skipif(not __import__("miles_engine.cpu_linear").cpu_linear.available(), reason="needs oneDNN")
def test_a_bucket_repacks_only_the_layers_it_wrote(dense_path, dense_path_seed1):
    """The CPU engine keeps packed copies of its linear weights; a weight-sync bucket must refresh
    the ones it wrote (the tied head with its embedding) and leave the rest alone."""
    from miles_engine.cpu_linear import PackedLinears

    model, trained = load(dense_path), load(dense_path_seed1)
    store, packed = WeightStore(model), PackedLinears(model)
    q = "model.layers.0.self_attn.q_proj.weight"
    store.load([(q, trained.state_dict()[q])])
    assert packed.repack(store.take_changed()) == 1 and store.take_changed() == set()
    store.load([("model.embed_tokens.weight", trained.state_dict()["model.embed_tokens.weight"])])
    assert packed.repack(store.take_changed()) == 1  # lm_head shares the embedding's storage
    x = torch.randn(1, 8, model.config.hidden_size)  # 8 rows: the packed path
    with torch.no_grad():
        for layer in (model.model.layers[0].self_attn.q_proj, model.lm_head):
            assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight), atol=1e-5)
    assert packed.repack(set()) == 0 and packed.repack() == len(packed.layers)
