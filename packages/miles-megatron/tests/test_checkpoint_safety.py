"""Resuming reads a folder that may come from anywhere: a pickle planted in any file the megatron
backend's ``load_checkpoint`` reads (megatron-core's ``metadata.json``, ``common.pt``, DCP's
``.metadata``, a sharded object inside the ``.distcp`` files, a layer's extra state, the RNG file)
is refused with a clear error and runs nothing, and the same backend then resumes from a good
checkpoint as usual."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from miles.trainer.safe_checkpoint import UnsafeCheckpointError
from miles_contracts.testing.backend import make_test_batch


class _Runs:
    """Pickles to ``os.system(command)``: what an attacker plants."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple:
        return os.system, (self.command,)


def _first_linear(backend):
    return backend.actor.chunks[0].decoder.layers[0].self_attention.linear_proj


@pytest.mark.slow
def test_resume_refuses_every_planted_file_and_still_loads_a_good_checkpoint(tiny_dense, backend_factory, tmp_path,
                                                                            monkeypatch) -> None:
    """The layer extra-state case: Transformer Engine (GPU only) would ``pickle.loads`` a non-empty
    byte tensor; the CPU's local layers ignore extra state, so here the refusal is what shows it."""
    # with this set, any torch.load that relies on torch's default would unpickle anything
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    marker = tmp_path / "pwned"
    evil = _Runs(f"touch {marker}")
    saver = backend_factory(tiny_dense)
    batch = make_test_batch(tiny_dense)
    old = saver.compute_logprobs(batch)
    saver.train_step(replace(batch, advantages=torch.where(batch.loss_mask > 0, 1.0, 0.0), old_logprobs=old,
                             rollout_logprobs=old))  # megatron-core's optimizer saves a state once it stepped
    good = tmp_path / "good"
    saver.save_checkpoint(good, {"note": "x"})
    saved = {name: tensor.clone() for name, tensor in saver.named_weights()}

    layer = _first_linear(saver)
    layer.get_extra_state = lambda: evil  # a sharded object: pickled into the .distcp files
    saver.save_checkpoint(tmp_path / "object", {})
    te_state = torch.frombuffer(bytearray(pickle.dumps(evil)), dtype=torch.uint8)
    layer.get_extra_state = lambda: te_state  # Transformer Engine's format: a byte tensor holding a pickle
    saver.save_checkpoint(tmp_path / "extra_state", {})
    del layer.get_extra_state

    def planted(name: str, write) -> Path:
        folder = tmp_path / name
        shutil.copytree(good, folder)
        write(folder / "megatron")
        return folder

    formats = {"sharded_backend": "zarr", "sharded_backend_version": 1, "common_backend": "torch",
               "common_backend_version": 1}
    cases = {
        planted("formats", lambda m: (m / "metadata.json").write_text(json.dumps(formats))): "names the formats",
        planted("common", lambda m: torch.save({"optimizer": evil}, m / "common.pt")): r"refusing .*common\.pt.*system",
        planted("metadata", lambda m: (m / ".metadata").write_bytes(pickle.dumps(evil))): r"refusing (posix|os)\.system",
        tmp_path / "object": r"refusing the checkpoint value '.*linear_proj\._extra_state",
        tmp_path / "extra_state": r"refusing .*linear_proj\._extra_state: it holds a layer's extra state",
        planted("rng", lambda m: torch.save({"torch": evil}, m.parent / "rng" / "rank_0.pt")): r"rank_0\.pt.*system",
    }
    resumed = backend_factory(tiny_dense)
    for folder, message in cases.items():
        with pytest.raises((UnsafeCheckpointError, ValueError), match=message):
            resumed.load_checkpoint(folder)
    assert not marker.exists()

    assert resumed.load_checkpoint(good) == {"note": "x"}
    for name, tensor in resumed.named_weights():
        assert torch.equal(tensor, saved[name]), name
