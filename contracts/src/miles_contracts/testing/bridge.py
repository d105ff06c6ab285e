"""Conformance suite for :class:`miles_contracts.ModelBridge` implementations.

Run it from a test of your bridge package on a tiny random checkpoint (seconds on a CPU)::

    from miles_contracts.testing.bridge import check_model_bridge

    def test_bridge_conforms(tiny_checkpoint_dir):
        report = check_model_bridge(MyBridge(), tiny_checkpoint_dir)
        assert report.megatron_tensors > 0

It checks that

* HF -> megatron -> HF gives back every tensor bit-exactly (same names, dtypes, shapes, bytes):
  no tensor lost, none invented; and megatron -> HF -> megatron does too;
* the conversion keeps dtypes (run once as stored and once in bfloat16) and leaves its input alone;
* the megatron tensors have the shapes ``megatron_config(hf_config)`` implies: fused QKV rows
  ``(heads + 2 * groups) * kv_channels``, gated ``linear_fc1`` rows ``2 * ffn``, one tensor set
  per layer and per expert, ``output_layer`` only when embeddings are untied;
* ``megatron_config`` has the documented shape: ``transformer_config``, ``gpt_model`` and
  ``layer_spec`` mappings.

Failures raise ``AssertionError`` naming every offending tensor. Needs torch and safetensors
(imported when the suite runs, never when ``miles_contracts`` is imported).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_contracts.bridges import decoder_layer, takes_partial

if TYPE_CHECKING:
    import torch

    from miles_contracts.protocols import ModelBridge

_LAYER = r"decoder\.layers\.(\d+)\."


@dataclass(frozen=True, slots=True)
class BridgeReport:
    """What :func:`check_model_bridge` verified.

    :ivar hf_tensors: HF tensors round-tripped.
    :ivar megatron_tensors: megatron tensors produced.
    :ivar shape_checked: megatron tensors whose shape was checked against ``megatron_config``.
    :ivar unchecked: megatron names the suite has no shape rule for (e.g. MLA or shared experts);
        round-tripped, but not shape-checked.
    :ivar parameters: elements in all HF tensors.
    :ivar seconds: wall time of the whole check.
    """

    hf_tensors: int
    megatron_tensors: int
    shape_checked: int
    unchecked: tuple[str, ...]
    parameters: int
    seconds: float


def load_hf_checkpoint(model_dir: Path | str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(state, config)`` of an HF checkpoint folder: every ``*.safetensors`` file and ``config.json``."""
    try:
        from safetensors.torch import load_file
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("the bridge suite reads checkpoints with safetensors: pip install safetensors") from exc
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors file; save the model with safe_serialization=True")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    config = json.loads((model_dir / "config.json").read_text())
    return state, config


def check_model_bridge(
    bridge: ModelBridge,
    hf_model_dir_or_state: Path | str | Mapping[str, torch.Tensor],
    hf_config: Mapping[str, Any] | None = None,
) -> BridgeReport:
    """Check ``bridge`` on a checkpoint folder, or on an HF state dict in checkpoint form with its
    ``hf_config``. Returns what was checked; raises ``AssertionError`` on the first broken rule."""
    start = time.perf_counter()
    if isinstance(hf_model_dir_or_state, (str, Path)):
        hf_state, disk_config = load_hf_checkpoint(hf_model_dir_or_state)
        hf_config = hf_config if hf_config is not None else disk_config
    else:
        if hf_config is None:
            raise TypeError("check_model_bridge(bridge, state, hf_config): a state dict needs its hf_config")
        hf_state = dict(hf_model_dir_or_state)
    _check_attributes(bridge)
    mcfg = bridge.megatron_config(hf_config)
    _check_megatron_config(mcfg)

    import torch

    shape_checked, unchecked = 0, tuple[str, ...]()
    for dtype in (None, torch.bfloat16):
        state = hf_state if dtype is None else {k: v.to(dtype) for k, v in hf_state.items()}
        reference = {k: v.clone() for k, v in state.items()}
        mcore = bridge.to_megatron(state, hf_config)
        _expect_same(reference, state, "to_megatron changed its input")
        shape_checked, unchecked = _check_megatron_shapes(mcore, mcfg)
        back = bridge.to_hf(mcore, hf_config)
        _expect_same(reference, back, "HF -> megatron -> HF")
        _expect_same(mcore, bridge.to_megatron(back, hf_config), "megatron -> HF -> megatron")
    if takes_partial(bridge.to_megatron):
        _check_streaming(bridge, hf_state, hf_config, bridge.to_megatron(hf_state, hf_config))
    return BridgeReport(
        hf_tensors=len(hf_state),
        megatron_tensors=len(mcore),
        shape_checked=shape_checked,
        unchecked=unchecked,
        parameters=sum(t.numel() for t in hf_state.values()),
        seconds=time.perf_counter() - start,
    )


# ----------------------------------------------------------------------------- the checks


def _check_streaming(bridge: Any, hf_state: Mapping[str, torch.Tensor], hf_config: Mapping[str, Any],
                     whole: Mapping[str, torch.Tensor]) -> None:
    """What the megatron backend relies on when ``to_megatron`` takes ``partial``: meta tensors
    give the names and shapes, and the decoder layers converted one at a time (the rest
    together) give exactly the tensors of one whole conversion."""
    import torch

    meta = bridge.to_megatron({k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in hf_state.items()},
                              hf_config)
    assert {k: tuple(v.shape) for k, v in meta.items()} == {k: tuple(v.shape) for k, v in whole.items()}, \
        "to_megatron on meta tensors gives other names or shapes than on the weights"
    groups: dict[int | None, dict[str, torch.Tensor]] = {}
    for name, tensor in hf_state.items():
        groups.setdefault(decoder_layer(name), {})[name] = tensor
    streamed: dict[str, torch.Tensor] = {}
    for layer, group in groups.items():
        part = bridge.to_megatron(group, hf_config, partial=True)
        clash = streamed.keys() & part.keys()
        assert not clash, f"to_megatron(partial=True) made {sorted(clash)[:4]} again from layer {layer}"
        streamed.update(part)
    _expect_same(whole, streamed, "to_megatron one decoder layer at a time (partial=True)")


def _check_attributes(bridge: Any) -> None:
    name = getattr(bridge, "name", None)
    if not isinstance(name, str) or not name:
        raise AssertionError(f"bridge.name must be a non-empty str, got {name!r}")
    family = getattr(bridge, "chat_family", None)
    if family is not None and not isinstance(family, str):
        raise AssertionError(f"bridge.chat_family must be a str or None, got {family!r}")
    for method in ("to_megatron", "to_hf", "megatron_config"):
        if not callable(getattr(bridge, method, None)):
            raise AssertionError(f"bridge {name!r} has no method {method}()")


def _check_megatron_config(mcfg: Any) -> None:
    if not isinstance(mcfg, Mapping):
        raise AssertionError(f"megatron_config() must return a mapping, got {type(mcfg).__name__}")
    for part, keys in {
        "transformer_config": ("num_layers", "hidden_size", "num_attention_heads"),
        "gpt_model": ("vocab_size", "share_embeddings_and_output_weights"),
        "layer_spec": ("function", "kwargs"),
    }.items():
        section = mcfg.get(part)
        if not isinstance(section, Mapping):
            raise AssertionError(f"megatron_config()[{part!r}] must be a mapping, got {section!r}")
        missing = [k for k in keys if k not in section]
        if missing:
            raise AssertionError(f"megatron_config()[{part!r}] lacks {', '.join(missing)}")


def _expected_shapes(mcfg: Mapping[str, Any]) -> list[tuple[re.Pattern[str], tuple[int, ...]]]:
    """megatron-core's tensor shapes by name, from the model's megatron config."""
    tc, gm = mcfg["transformer_config"], mcfg["gpt_model"]
    hidden, heads = tc["hidden_size"], tc["num_attention_heads"]
    groups = tc.get("num_query_groups") or heads
    head_dim = tc.get("kv_channels") or hidden // heads
    glu = 2 if tc.get("gated_linear_unit") else 1
    ffn = tc.get("ffn_hidden_size") or 4 * hidden
    moe_ffn = tc.get("moe_ffn_hidden_size") or ffn
    qkv = (heads + 2 * groups) * head_dim
    table = {
        r"embedding\.word_embeddings\.weight": (gm["vocab_size"], hidden),
        r"output_layer\.weight": (gm["vocab_size"], hidden),
        r"decoder\.final_layernorm\.weight": (hidden,),
        _LAYER + r"self_attention\.linear_qkv\.weight": (qkv, hidden),
        _LAYER + r"self_attention\.linear_qkv\.bias": (qkv,),
        _LAYER + r"(input_layernorm|pre_mlp_layernorm)\.weight": (hidden,),
        _LAYER + r"(self_attention\.linear_qkv|mlp\.linear_fc1)\.layer_norm_weight": (hidden,),
        _LAYER + r"self_attention\.linear_proj\.weight": (hidden, heads * head_dim),
        _LAYER + r"(self_attention\.linear_proj|mlp\.linear_fc2)\.bias": (hidden,),
        _LAYER + r"self_attention\.[qk]_layernorm\.weight": (head_dim,),
        _LAYER + r"mlp\.linear_fc1\.weight": (glu * ffn, hidden),
        _LAYER + r"mlp\.linear_fc1\.bias": (glu * ffn,),
        _LAYER + r"mlp\.linear_fc2\.weight": (hidden, ffn),
        _LAYER + r"mlp\.router\.weight": (tc.get("num_moe_experts") or 0, hidden),
        _LAYER + r"mlp\.experts\.(local_experts\.\d+\.linear_fc1\.weight|linear_fc1\.weight\d+)": (glu * moe_ffn, hidden),
        _LAYER + r"mlp\.experts\.(local_experts\.\d+\.linear_fc2\.weight|linear_fc2\.weight\d+)": (hidden, moe_ffn),
    }
    return [(re.compile(pattern), shape) for pattern, shape in table.items()]


def _check_megatron_shapes(mcore: Mapping[str, Any], mcfg: Mapping[str, Any]) -> tuple[int, tuple[str, ...]]:
    import torch

    tc, gm = mcfg["transformer_config"], mcfg["gpt_model"]
    not_tensors = [n for n, t in mcore.items() if not isinstance(t, torch.Tensor)]
    if not_tensors:
        raise AssertionError(f"to_megatron returned non-tensors for: {', '.join(not_tensors)}")
    problems, unchecked, checked = [], [], 0
    rules = _expected_shapes(mcfg)
    for name, tensor in mcore.items():
        expected = next((shape for pattern, shape in rules if pattern.fullmatch(name)), None)
        if expected is None:
            unchecked.append(name)
        elif tuple(tensor.shape) != expected:
            problems.append(f"{name}: shape {tuple(tensor.shape)}, megatron_config implies {expected}")
        else:
            checked += 1

    layers = {int(m.group(1)) for n in mcore if (m := re.match(_LAYER, n))}
    if layers != set(range(tc["num_layers"])):
        problems.append(f"decoder layers present: {sorted(layers)}, megatron_config has num_layers={tc['num_layers']}")
    tied = bool(gm["share_embeddings_and_output_weights"])
    if tied == ("output_layer.weight" in mcore):
        problems.append(
            f"output_layer.weight is {'present' if tied else 'missing'} but share_embeddings_and_output_weights={tied}"
        )
    experts = tc.get("num_moe_experts")
    if experts:
        per_layer: dict[int, set[int]] = {}
        for name in mcore:
            m = re.match(_LAYER + r"mlp\.experts\.(?:local_experts\.(\d+)\.linear_fc1\.weight|linear_fc1\.weight(\d+))$", name)
            if m:
                per_layer.setdefault(int(m.group(1)), set()).add(int(m.group(2) or m.group(3)))
        bad = {layer: sorted(found) for layer, found in per_layer.items() if found != set(range(experts))}
        if not per_layer or bad:
            problems.append(f"expert fc1 tensors per layer {bad or 'none found'}, megatron_config has num_moe_experts={experts}")
    if problems:
        raise AssertionError("megatron tensors do not fit megatron_config:\n  " + "\n  ".join(problems))
    return checked, tuple(unchecked)


def _expect_same(expected: Mapping[str, torch.Tensor], actual: Mapping[str, torch.Tensor], what: str) -> None:
    """Same names, dtypes, shapes and bytes (``torch.equal`` would let ``-0.0 == 0.0`` and fail on NaN)."""
    lost, invented = sorted(expected.keys() - actual.keys()), sorted(actual.keys() - expected.keys())
    differ = []
    for name in sorted(expected.keys() & actual.keys()):
        a, b = expected[name], actual[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            differ.append(f"{name}: {b.dtype} {tuple(b.shape)} instead of {a.dtype} {tuple(a.shape)}")
        elif not _bytes_equal(a, b):
            differ.append(f"{name}: values differ")
    if lost or invented or differ:
        lines = [f"{what} is not bit-exact:"]
        lines += [f"  lost: {', '.join(lost)}"] if lost else []
        lines += [f"  invented: {', '.join(invented)}"] if invented else []
        lines += [f"  {d}" for d in differ]
        raise AssertionError("\n".join(lines))


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    import torch

    if a.numel() == 0:
        return True
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))
