"""The bridge against a real megatron-core GPTModel built on CPU: names, shapes and logits.

megatron-core 0.16 runs on CPU with three small patches (see
``miles_contracts.testing.megatron.cpu_megatron``); Transformer Engine cannot run here, so models
are built with megatron-core's local layer spec and the Transformer Engine names are checked
through megatron-core's own mapping between the two (``sharded_state_dict_keys_map``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from miles_model_llama import LOCAL, LlamaBridge

pytestmark = pytest.mark.slow  # importing megatron-core alone takes ~10 s on 2 cores


@pytest.fixture(scope="module")
def megatron() -> Iterator[None]:
    from miles_contracts.testing.megatron import cpu_megatron

    with cpu_megatron():
        yield


@pytest.mark.parametrize("model", ["tiny_dense", "tiny_untied", "tiny_biased"])
def test_megatron_model_matches_names_shapes_and_logits(megatron: None, model: str, request: pytest.FixtureRequest) -> None:
    from miles_contracts.testing.megatron import check_against_megatron

    report = check_against_megatron(LlamaBridge(LOCAL), request.getfixturevalue(model))
    # fp32 on CPU: same math in a different order. A wrong head order, rope or norm moves
    # logits by > 0.1 on these models.
    assert report.max_logit_diff < 1e-3, report


def test_smollm2_logits_match_megatron(megatron: None) -> None:
    from miles_contracts.testing.megatron import check_against_megatron
    from miles_models import pull

    report = check_against_megatron(LlamaBridge(LOCAL), pull("smollm2-135m-instruct", progress=False))
    assert report.tensors == 2 + 30 * 6 and report.max_logit_diff < 1e-3, report


def test_transformer_engine_names_are_megatron_cores_own(megatron: None, tiny_untied) -> None:
    """megatron-core maps local-spec names to Transformer Engine names for its checkpoints; the
    default layout must produce exactly those names."""
    from miles_contracts.testing.bridge import load_hf_checkpoint
    from miles_contracts.testing.megatron import build_gpt_model

    state, config = load_hf_checkpoint(tiny_untied)
    model = build_gpt_model(LlamaBridge(LOCAL).megatron_config(config))
    te_names = set()
    for name in model.state_dict():
        if name.endswith("_extra_state"):
            continue
        if name.startswith("decoder.layers."):
            index = int(name.split(".")[2])
            prefix = f"decoder.layers.{index}."
            keys_map = model.decoder.layers[index].submodules_config.sharded_state_dict_keys_map
            local = name.removeprefix(prefix)
            for old, new in keys_map.items():
                if local.startswith(old):
                    local = new + local.removeprefix(old)
            name = prefix + local
        te_names.add(name)
    assert set(LlamaBridge().to_megatron(state, config)) == te_names
