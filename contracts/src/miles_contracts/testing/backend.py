"""Conformance suite for train backends: ``check_train_backend(factory, model_dir, work_dir=...)``.

Every backend (FSDP, Megatron, ...) runs the same rules on a tiny checkpoint, from a test of its
package::

    from miles.context import context_for
    from miles_contracts import Process
    from miles_contracts.testing.backend import check_train_backend

    def test_backend_conforms(tmp_path):
        ctx = context_for(config_for(tiny_dir), Process.trainer_rank(0))   # what a trainer rank gets
        bridge = ctx.kernel.model_bridge(json.loads((tiny_dir / "config.json").read_text()))
        report = check_train_backend(lambda: MyBackend(ctx), tiny_dir, work_dir=tmp_path, bridge=bridge)

``factory()`` must build a *fresh* backend over the HF checkpoint ``model_dir`` each time, with
log-probs at temperature 1, a learning rate that visibly moves a tiny model in one step (about
1e-3), ``updates_per_step: 1``, a PPO-style policy loss and no critic. The suite checks, and raises
``AssertionError`` naming the first broken rule:

1. ``named_weights()`` yields exactly the checkpoint's tensors (HF names, values within
   ``weight_atol``; a tied output head may be left out);
2. the weights round-trip through the model bridge bit-exactly (HF -> Megatron -> HF);
3. ``compute_logprobs`` is ``[B, T]``, matches a plain transformers forward within
   ``logprob_atol`` on ``loss_mask`` positions and is exactly 0 elsewhere;
4. ``train_step`` refuses a batch without advantages with ``ValueError``; on a fixed batch whose
   advantages are all +1 it returns finite ``loss``, ``grad_norm`` and ``lr``, a train/rollout
   mismatch near 0 (rollout log-probs come from the plain forward), a second step on the same
   batch reports a lower loss, and the rewarded tokens' log-probs went up;
5. ``export_hf`` writes a folder ``AutoModelForCausalLM.from_pretrained`` loads, whose log-probs
   equal the backend's;
6. ``save_checkpoint`` / ``load_checkpoint`` into a fresh backend: the extra state comes back,
   the weights are identical, and one more step on each gives identical weights.

With several ranks, every rank calls the suite (backends are SPMD); ``work_dir`` must be the same
folder on every rank. ``named_weights()`` is collective and only rank 0 must yield (other ranks may
yield the same tensors or nothing), so the weight rules run on the ranks that yield, and a
backend's ``named_weights()`` is always consumed to the end before another one starts. torch and
transformers are imported when the suite runs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_contracts.batch import TrainBatch

if TYPE_CHECKING:
    import torch

    from miles_contracts.protocols import ModelBridge, TrainBackend


@dataclass(frozen=True, slots=True)
class BackendReport:
    """What :func:`check_train_backend` measured.

    :ivar weights: tensors yielded by ``named_weights``.
    :ivar logprob_max_diff: largest |backend - plain forward| log-prob difference.
    :ivar loss_before / loss_after: ``loss`` of the first and second step on the fixed batch.
    :ivar bridge: name of the bridge the weights went through.
    """

    weights: int
    logprob_max_diff: float
    loss_before: float
    loss_after: float
    bridge: str


def make_test_batch(model_dir: Path | str, *, lengths: tuple[int, ...] = (12, 7, 16, 5, 9), prompt: int = 3, seed: int = 0) -> TrainBatch:
    """A right-padded batch of random tokens: rows of ``lengths`` tokens, the first ``prompt`` of
    each row untrained; two prompt groups; ``rollout_logprobs`` zero (fill them as needed)."""
    import torch

    config = json.loads((Path(model_dir) / "config.json").read_text())
    vocab = int(config["vocab_size"])
    pad = config.get("pad_token_id")
    pad = int(pad) if isinstance(pad, int) else 0
    gen = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(lengths)
    tokens = torch.full((b, t), pad, dtype=torch.long)
    attention = torch.zeros(b, t, dtype=torch.long)
    loss_mask = torch.zeros(b, t)
    for row, n in enumerate(lengths):
        tokens[row, :n] = torch.randint(0, vocab, (n,), generator=gen)
        attention[row, :n] = 1
        loss_mask[row, prompt:n] = 1.0
    return TrainBatch(
        tokens=tokens, attention_mask=attention, loss_mask=loss_mask, rollout_logprobs=torch.zeros(b, t),
        rewards=torch.ones(b), group_ids=torch.arange(b) % 2, rollout_ids=torch.arange(b),
    )


def plain_logprobs(model_dir: Path | str, batch: TrainBatch) -> torch.Tensor:
    """``[B, T]`` log-probs from a plain fp32 transformers forward (full logits), 0 off ``loss_mask``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]  # transformers' auto class stubs leave eval untyped
    with torch.no_grad():
        logits = model(input_ids=batch.tokens, attention_mask=batch.attention_mask).logits.float()  # [B, T, V]
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(2, batch.tokens[:, 1:, None]).squeeze(2)
    logp = torch.cat([torch.zeros(batch.size, 1), logp], dim=1)
    return torch.where(batch.loss_mask > 0, logp, torch.zeros_like(logp))


def check_train_backend(
    factory: Callable[[], TrainBackend],
    model_dir: Path | str,
    *,
    work_dir: Path | str,
    bridge: ModelBridge,
    logprob_atol: float = 1e-4,
    weight_atol: float = 0.0,
    resume_atol: float = 0.0,
) -> BackendReport:
    """Run every rule on backends built by ``factory`` (see the module docstring).

    :param bridge: the model bridge of the checkpoint (``ctx.kernel.model_bridge(config)``).
    :param logprob_atol: tolerance against the plain forward (fp32 CPU: 1e-4; bf16: larger).
    :param weight_atol: tolerance of ``named_weights`` against the checkpoint (0 = exact).
    :param resume_atol: tolerance between the original and the resumed backend's weights one
        step after resuming (0 = bitwise, right for deterministic fp32 CPU runs).
    """

    from miles_contracts.testing.bridge import load_hf_checkpoint

    model_dir, work_dir = Path(model_dir), Path(work_dir)
    stored, hf_config = load_hf_checkpoint(model_dir)
    backend = factory()
    weights = _all_weights(backend)
    if weights or _rank() == 0:
        _check_weights(weights, stored, hf_config, weight_atol)
        _check_bridge_round_trip(weights, hf_config, bridge)

    batch = make_test_batch(model_dir)
    reference = plain_logprobs(model_dir, batch)
    logprobs = backend.compute_logprobs(batch).cpu()
    max_diff = _check_logprobs("compute_logprobs", logprobs, reference, batch, logprob_atol)

    batch = replace(batch, rollout_logprobs=reference)
    try:
        backend.train_step(batch)
    except ValueError:
        pass
    else:
        raise AssertionError("train_step accepted a batch without advantages; it must raise ValueError")
    before, after = _check_training(backend, batch, logprobs, max(1e-2, logprob_atol))

    export = work_dir / "export"
    backend.export_hf(export)
    _check_logprobs("export_hf", plain_logprobs(export, batch), backend.compute_logprobs(batch).cpu(), batch, logprob_atol)

    _check_checkpoint(backend, factory, batch, work_dir / "checkpoint", resume_atol)
    backend.close()
    return BackendReport(len(weights), max_diff, before, after, getattr(bridge, "name", type(bridge).__name__))


# ----------------------------------------------------------------------------- rules


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _all_weights(backend: TrainBackend) -> dict[str, Any]:
    """Every tensor ``named_weights()`` yields here (consumed to the end: it is collective)."""
    return {name: t.detach().cpu().clone() for name, t in backend.named_weights()}


def _check_weights(weights: dict[str, Any], stored: dict[str, Any], hf_config: dict[str, Any], atol: float) -> None:
    import torch

    missing = sorted(set(stored) - set(weights))
    if hf_config.get("tie_word_embeddings"):
        missing = [n for n in missing if n != "lm_head.weight"]
    extra = sorted(set(weights) - set(stored))
    if missing or extra:
        raise AssertionError(f"named_weights names differ from the checkpoint: missing {missing}, unexpected {extra}")
    for name, tensor in weights.items():
        want = stored[name]
        if tensor.shape != want.shape:
            raise AssertionError(f"named_weights {name}: shape {tuple(tensor.shape)}, checkpoint {tuple(want.shape)}")
        diff = (tensor.float() - want.float()).abs().max().item() if tensor.numel() else 0.0
        if diff > atol:
            raise AssertionError(f"named_weights {name} differs from the checkpoint by {diff:.3g} (> {atol})")
        if not torch.isfinite(tensor.float()).all():
            raise AssertionError(f"named_weights {name} has non-finite values")


def _check_bridge_round_trip(weights: dict[str, Any], hf_config: dict[str, Any], bridge: ModelBridge) -> None:
    import torch

    back = bridge.to_hf(bridge.to_megatron(weights, hf_config), hf_config)
    lost = sorted(set(weights) - set(back))
    invented = sorted(set(back) - set(weights))
    if lost or invented:
        raise AssertionError(f"bridge round trip changed names: lost {lost}, invented {invented}")
    changed = [n for n, t in weights.items() if back[n].dtype != t.dtype or not torch.equal(back[n], t)]
    if changed:
        raise AssertionError(f"bridge round trip changed the values of {changed}")


def _check_logprobs(what: str, got: torch.Tensor, want: torch.Tensor, batch: TrainBatch, atol: float) -> float:
    import torch

    if tuple(got.shape) != tuple(batch.tokens.shape) or got.dtype != torch.float32:
        raise AssertionError(f"{what}: expected float32 {tuple(batch.tokens.shape)}, got {got.dtype} {tuple(got.shape)}")
    off = batch.loss_mask <= 0
    if bool((got[off] != 0).any()):
        raise AssertionError(f"{what}: log-probs must be exactly 0 off loss_mask")
    diff = float((got - want).abs().max())
    if not diff <= atol:
        raise AssertionError(f"{what}: log-probs differ from the plain forward by {diff:.3g} (> {atol})")
    return diff


def _check_training(backend: TrainBackend, batch: TrainBatch, old: torch.Tensor, mismatch_atol: float) -> tuple[float, float]:
    import torch

    advantages = torch.where(batch.loss_mask > 0, torch.ones_like(batch.loss_mask), torch.zeros_like(batch.loss_mask))
    fixed = replace(batch, old_logprobs=old, advantages=advantages)
    first = backend.train_step(fixed)
    for key in ("loss", "grad_norm", "lr"):
        if key not in first or not math.isfinite(first[key]):
            raise AssertionError(f"train_step metrics need a finite {key!r}; got {first}")
    mismatch = first.get("train_rollout_logprob_abs_diff")
    if mismatch is None or not mismatch <= mismatch_atol:
        raise AssertionError(f"train_rollout_logprob_abs_diff should be ~0 when rollout log-probs are exact; got {mismatch}")
    second = backend.train_step(fixed)
    if not second["loss"] < first["loss"]:
        raise AssertionError(f"one step did not reduce the loss on a fixed batch: {first['loss']} -> {second['loss']}")
    after = backend.compute_logprobs(batch).cpu()
    mask = batch.loss_mask > 0
    if not float(after[mask].mean()) > float(old[mask].mean()):
        raise AssertionError("after steps with advantage +1 everywhere, the mean log-prob of the trained tokens did not rise")
    return first["loss"], second["loss"]


def _check_checkpoint(
    backend: TrainBackend, factory: Callable[[], TrainBackend], batch: TrainBatch, path: Path, atol: float,
) -> None:
    import torch

    extra = {"data_position": 17, "epoch": 1, "note": "resume here"}
    backend.save_checkpoint(path, extra)
    resumed = factory()
    got = resumed.load_checkpoint(path)
    if got != extra:
        raise AssertionError(f"load_checkpoint returned {got}, saved {extra}")
    _same_weights(backend, resumed, "after load_checkpoint", 0.0)
    old = backend.compute_logprobs(batch)
    advantages = torch.where(batch.loss_mask > 0, -torch.ones_like(batch.loss_mask), torch.zeros_like(batch.loss_mask))
    step = replace(batch, old_logprobs=old, advantages=advantages)
    backend.train_step(step)
    resumed.train_step(step)
    _same_weights(backend, resumed, "one step after resuming (optimizer state or schedule not restored?)", atol)
    resumed.close()


def _same_weights(a: TrainBackend, b: TrainBackend, when: str, atol: float) -> None:
    weights_a, weights_b = _all_weights(a), _all_weights(b)  # one collective after the other
    if list(weights_a) != list(weights_b):
        raise AssertionError(f"{when}: the two backends yield different weight names or order")
    for (name_a, ta), tb in zip(weights_a.items(), weights_b.values(), strict=True):
        diff = float((ta.float() - tb.float()).abs().max()) if ta.numel() else 0.0
        if not diff <= atol:
            raise AssertionError(f"{when}: weight {name_a} differs by {diff:.3g} between the original and the resumed backend")
