"""Model provisioning: name resolution, the cache listing, tiny test models.

The SmolLM2 pull itself (one ~93 MB download and a GGUF conversion) is done once per machine and
cached under ~/.cache/miles; these tests use that cache and never download.
"""

from __future__ import annotations

import json

import pytest
import torch
from miles.cli.main import main as miles_main
from miles_models import ModelNotFoundError, list_cached, resolve_model
from miles_models.cache import MARKER
from miles_models.testing import tiny_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

SMOLLM = "smollm2-135m-instruct"


@pytest.fixture
def empty_home(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_a_folder_with_a_config_resolves_to_itself(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_a_folder_without_config_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve_model(str(tmp_path))


def test_an_unknown_name_lists_the_known_models():
    with pytest.raises(ModelNotFoundError, match=f"neither a local folder nor a known model; known models: {SMOLLM}"):
        resolve_model("gpt-17-ultra")


def test_the_kernel_suggests_the_closest_catalogued_name_for_an_unknown_one():
    from miles.errors import PluginError
    from miles.kernel import Kernel

    kernel = Kernel.load()
    assert kernel.model_names() == [SMOLLM]  # miles_model_names: what this plugin resolves
    with pytest.raises(PluginError, match=f"Did you mean '{SMOLLM}'\\? Known models: {SMOLLM}"):
        kernel.resolve_model("smollm2-135m")


def test_a_known_but_uncached_model_says_how_to_pull_it(empty_home):
    with pytest.raises(ModelNotFoundError, match=f"miles models pull {SMOLLM}"):
        resolve_model(SMOLLM)


def test_an_interrupted_conversion_is_not_a_cached_model(empty_home):
    partial = empty_home / "models" / SMOLLM
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")  # no marker: the conversion never finished
    assert list_cached() == []
    with pytest.raises(ModelNotFoundError, match="not in the cache"):
        resolve_model(SMOLLM)


def test_the_pulled_model_resolves_and_loads():
    path = resolve_model(SMOLLM)
    assert (path / MARKER).is_file()
    assert json.loads((path / MARKER).read_text())["name"] == SMOLLM
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == "llama" and config.num_hidden_layers == 30
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    assert [m.name for m in list_cached() if m.name == SMOLLM] == [SMOLLM]


def test_models_list_shows_cached_and_missing_models(capsys, empty_home):
    assert miles_main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert str(empty_home / "models") in out
    assert f"not cached (miles models pull {SMOLLM})" in out


def test_models_list_shows_the_real_cache(capsys):
    assert miles_main(["models", "list"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(SMOLLM))
    assert "cached" in line and "MB" in line and "not cached" not in line


def test_models_pull_rejects_an_unknown_name(capsys):
    with pytest.raises(SystemExit):
        miles_main(["models", "pull", "gpt-17-ultra"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tiny_models_are_small_real_models_with_the_smollm_tokenizer(kind):
    path = tiny_model(kind)
    assert tiny_model(kind) == path  # built once, then reused
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = model.config
    assert config.num_hidden_layers == 2 and config.hidden_size == 64
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == config.vocab_size and tokenizer.eos_token_id == config.eos_token_id
    ids = tokenizer("hello world", return_tensors="pt").input_ids
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config.vocab_size) and torch.isfinite(logits).all()
    if kind == "moe":
        assert config.model_type == "qwen3_moe" and (config.num_experts, config.num_experts_per_tok) == (4, 2)
        assert len(model(ids, output_router_logits=True).router_logits) == 2
    else:
        assert config.model_type == "llama"


def test_tiny_models_of_other_seeds_differ():
    a = AutoModelForCausalLM.from_pretrained(tiny_model("dense"))
    b = AutoModelForCausalLM.from_pretrained(tiny_model("dense", seed=1))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(a.state_dict()[name], b.state_dict()[name])


def test_an_unknown_tiny_kind_is_refused():
    with pytest.raises(ValueError, match="choose 'dense' or 'moe'"):
        tiny_model("mamba")
