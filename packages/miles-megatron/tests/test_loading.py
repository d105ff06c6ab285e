"""Weights in: a checkpoint streamed one layer at a time gives the tensors of one whole conversion;
bridges without ``to_megatron(partial=)`` still load; a checkpoint that does not match the
bridge is refused before any weight is read. (On the tiny models' real safetensors files and
bridges; the parameters are plain tensors here, the backend tests load real megatron chunks.)"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from miles.kernel import Kernel
from miles_megatron.loading import Checkpoint, StreamedWeights, WholeWeights, weight_source
from miles_megatron.weights import Shard


class WholeOnly:
    """A bridge as third parties may write one: ``to_megatron`` without ``partial``."""

    def __init__(self, bridge: Any) -> None:
        self.bridge = bridge

    def to_megatron(self, hf_state: Mapping[str, torch.Tensor], hf_config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return self.bridge.to_megatron(hf_state, hf_config)


def _bridge(model_dir) -> tuple[Any, dict[str, Any]]:
    config = json.loads((model_dir / "config.json").read_text())
    return Kernel.load().model_bridge(config), config


def _params(source) -> dict[str, Shard]:
    """One unsharded parameter per megatron tensor, as a world-of-one rank holds them."""
    shapes = {name: t.shape for name, t in source.bridge.to_megatron(source.checkpoint.meta, source.hf_config).items()}
    return {name: Shard(param=torch.full(shape, float("nan")), name=name, dim=None, tp_size=1, tp_rank=0, glu=False,
                        representative=True) for name, shape in shapes.items()}


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_streaming_by_layer_gives_the_tensors_of_one_whole_conversion(request, kind: str) -> None:
    model_dir = request.getfixturevalue(f"tiny_{kind}")
    bridge, config = _bridge(model_dir)
    streamed = weight_source(bridge, config, model_dir=model_dir)
    whole = weight_source(WholeOnly(bridge), config, model_dir=model_dir)
    assert isinstance(streamed, StreamedWeights) and isinstance(whole, WholeWeights)
    assert streamed.names == whole.names
    shards = _params(streamed)
    vocab = config["vocab_size"]
    streamed.load(list(shards.values()), vocab)
    assert streamed.layers_read == [None, *range(config["num_hidden_layers"])]
    for name, shard in shards.items():
        assert torch.equal(shard.param, whole.mcore[name]), name

    # a rank holding layer 1 only (a pipeline stage) reads that layer and nothing else
    mine = [s for name, s in shards.items() if ".layers.1." in name]
    streamed.load(mine, vocab)
    assert streamed.layers_read == [1]


def test_a_checkpoint_that_does_not_match_the_bridge_is_refused_before_any_weight_is_read(tiny_dense, tmp_path) -> None:
    from miles_model_llama.mapping import BridgeError
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_dense, broken)
    (file,) = broken.glob("*.safetensors")
    state = load_file(file)
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.1.mlp.odd.weight"] = torch.zeros(2)
    save_file(state, file)
    bridge, config = _bridge(broken)
    with pytest.raises(BridgeError) as info:
        weight_source(bridge, config, model_dir=broken)
    assert "model.layers.1.mlp.up_proj.weight" in str(info.value) and "model.layers.1.mlp.odd.weight" in str(info.value)


def test_checkpoint_reads_names_shapes_and_dtypes_from_the_headers(tiny_dense) -> None:
    checkpoint = Checkpoint(tiny_dense)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert checkpoint.meta[name].is_meta
    real = checkpoint.read([name])[name]
    assert real.shape == checkpoint.meta[name].shape and real.dtype == checkpoint.meta[name].dtype
    layers = [layer for layer, _ in checkpoint.groups()]
    assert layers == [None, 0, 1]
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        Checkpoint(tiny_dense.parent)
