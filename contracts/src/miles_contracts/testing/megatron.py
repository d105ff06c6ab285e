"""Check a model bridge against a real megatron-core ``GPTModel`` on CPU (optional suite).

Where :mod:`miles_contracts.testing.bridge` checks a bridge against itself, this builds the
``GPTModel`` that ``bridge.megatron_config(hf_config)`` describes and checks that

* the converted state dict has exactly the model's names and shapes (``_extra_state`` aside),
* the model loads it and gives it back unchanged through ``bridge.to_hf``,
* its logits equal the HF model's on the same tokens (fp32).

Needs megatron-core and transformers, and a bridge whose layout builds without Transformer Engine
(megatron-core's local layer spec). Runs in one process: :func:`cpu_megatron` sets up a one-rank
gloo world and patches the three CUDA-only calls megatron-core 0.16 makes on its forward path,
restoring everything on exit::

    from miles_contracts.testing.megatron import check_against_megatron, cpu_megatron

    def test_matches_megatron(tiny_checkpoint_dir):
        with cpu_megatron():
            report = check_against_megatron(MyBridge(layout=LOCAL), tiny_checkpoint_dir)
        assert report.max_logit_diff < 1e-4
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_contracts.testing.bridge import load_hf_checkpoint

if TYPE_CHECKING:
    import torch

    from miles_contracts.protocols import ModelBridge

# Fusions are CUDA kernels; on CPU megatron-core must take its plain PyTorch paths.
CPU_SAFE_SETTINGS: dict[str, Any] = {
    "use_cpu_initialization": True,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "masked_softmax_fusion": False,
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,
    "persist_layer_norm": False,
}


@dataclass(frozen=True, slots=True)
class MegatronReport:
    """What :func:`check_against_megatron` verified.

    :ivar tensors: megatron tensors compared by name and shape (``_extra_state`` excluded).
    :ivar max_logit_diff: largest absolute logit difference HF vs megatron-core.
    :ivar logits_shape: ``[B, T, V]`` of the compared logits.
    """

    tensors: int
    max_logit_diff: float
    logits_shape: tuple[int, ...]


@contextlib.contextmanager
def cpu_megatron() -> Iterator[None]:
    """A one-rank megatron-core world on CPU, torn down on exit.

    Patches, each undone on exit (all for megatron-core 0.16 without CUDA/Transformer Engine):

    * ``torch.cuda.current_device`` returns ``"cpu"``: the attention's global memory buffer asks
      for the CUDA device;
    * ``CudaRNGStatesTracker.fork`` is a no-op: it swaps CUDA RNG states around dropout, which the
      checks here keep at 0;
    * ``moe_utils.te_general_gemm`` is defined as None: megatron-core only defines it when
      Transformer Engine imports, yet the MoE router reads it.
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe import moe_utils

    created_group = not dist.is_initialized()
    if created_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    saved_device, saved_fork = torch.cuda.current_device, megatron_random.CudaRNGStatesTracker.fork
    had_gemm = hasattr(moe_utils, "te_general_gemm")
    # a device name where torch's stub promises an index (megatron-core passes it on as
    # ``device=``): patched through Any
    cuda: Any = torch.cuda
    cuda.current_device = lambda: "cpu"
    megatron_random.CudaRNGStatesTracker.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()
    if not had_gemm:
        moe_utils.te_general_gemm = None
    try:
        yield
    finally:
        torch.cuda.current_device = saved_device
        megatron_random.CudaRNGStatesTracker.fork = saved_fork
        if not had_gemm:
            del moe_utils.te_general_gemm
        parallel_state.destroy_model_parallel()
        if created_group:
            dist.destroy_process_group()


def build_gpt_model(megatron_config: Mapping[str, Any]) -> torch.nn.Module:
    """The ``GPTModel`` of ``megatron_config`` (``transformer_config``, ``gpt_model``,
    ``layer_spec``), on CPU, fp32, dropout off. Call inside :func:`cpu_megatron`."""
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs
    from megatron.core.transformer import TransformerConfig

    settings = {**megatron_config["transformer_config"], **CPU_SAFE_SETTINGS, "hidden_dropout": 0.0, "attention_dropout": 0.0}
    config = TransformerConfig(**settings)
    spec_fn = getattr(gpt_layer_specs, megatron_config["layer_spec"]["function"])
    spec = spec_fn(**megatron_config["layer_spec"]["kwargs"])
    model: torch.nn.Module = GPTModel(config, spec, **megatron_config["gpt_model"])
    return model


def megatron_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T, V]`` logits of ``input_ids: [B, T]``. Passes an explicit causal mask because
    megatron-core's default one is built on the CUDA device."""
    import torch

    batch, length = input_ids.shape
    positions = torch.arange(length).unsqueeze(0).expand(batch, -1)
    causal = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)[None, None]  # True = masked
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids, positions, attention_mask=causal)
    return logits


def check_against_megatron(bridge: ModelBridge, model_dir: Path | str, *, seq_len: int = 16, seed: int = 0) -> MegatronReport:
    """Build the megatron model for the checkpoint in ``model_dir``, load the bridge's conversion
    into it and compare names, shapes, round trip and logits with the HF model. Call inside
    :func:`cpu_megatron`. Raises ``AssertionError`` naming what differs."""
    import torch
    from transformers import AutoModelForCausalLM

    hf_state, hf_config = load_hf_checkpoint(model_dir)
    mcore = bridge.to_megatron(hf_state, hf_config)
    model = build_gpt_model(bridge.megatron_config(hf_config)).eval()
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items() if not n.endswith("_extra_state")}
    got = {n: tuple(t.shape) for n, t in mcore.items()}
    if got != expected:
        lines = [f"missing: {n} {s}" for n, s in sorted(expected.items()) if n not in got]
        lines += [f"unknown to megatron-core: {n} {s}" for n, s in sorted(got.items()) if n not in expected]
        lines += [f"{n}: {got[n]}, megatron-core has {s}" for n, s in sorted(expected.items()) if n in got and got[n] != s]
        raise AssertionError("converted names/shapes differ from megatron-core's GPTModel:\n  " + "\n  ".join(lines))
    result = model.load_state_dict(mcore, strict=False)
    leftover = [k for k in [*result.missing_keys, *result.unexpected_keys] if not k.endswith("_extra_state")]
    if leftover:
        raise AssertionError(f"GPTModel.load_state_dict left {leftover}")
    back = bridge.to_hf(model.state_dict(), hf_config)
    differ = sorted(n for n in hf_state if n not in back or not torch.equal(back[n], hf_state[n]))
    if differ or back.keys() != hf_state.keys():
        raise AssertionError(f"megatron-core model -> to_hf does not give the checkpoint back: {differ or sorted(back.keys() ^ hf_state.keys())}")

    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, int(hf_config["vocab_size"]), (2, seq_len), generator=generator)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    hf_model.eval()  # type: ignore[no-untyped-call]  # transformers' auto class stubs leave eval untyped
    with torch.no_grad():
        reference = hf_model(tokens).logits
    logits = megatron_logits(model, tokens)
    return MegatronReport(
        tensors=len(expected),
        max_logit_diff=float((logits.float() - reference.float()).abs().max()),
        logits_shape=tuple(logits.shape),
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port
