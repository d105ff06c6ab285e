"""Resuming reads a folder that may come from anywhere: a pickle planted in any file the fsdp
backend's ``load_checkpoint`` reads is refused with a clear error and runs nothing, and the
same backend then resumes from a good checkpoint as usual."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from miles.trainer.safe_checkpoint import UnsafeCheckpointError


class _Runs:
    """Pickles to ``os.system(command)``: what an attacker plants."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple:
        return os.system, (self.command,)


@pytest.mark.slow
def test_resume_refuses_every_planted_file_and_still_loads_a_good_checkpoint(tiny_dense, backend_factory, tmp_path,
                                                                            monkeypatch) -> None:
    # with this set, any torch.load that relies on torch's default would unpickle anything
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    marker = tmp_path / "pwned"
    evil = _Runs(f"touch {marker}")
    saver = backend_factory(tiny_dense)
    good = tmp_path / "good"
    saver.save_checkpoint(good, {"note": "x"})
    saved = {name: tensor.clone() for name, tensor in saver.named_weights()}

    # a non-tensor value of the DCP state (the optimizer's lr) that runs a command when loaded
    group = saver.trained[0].optimizer.param_groups[0]
    lr, group["lr"] = group["lr"], evil
    saver.save_checkpoint(tmp_path / "value", {})
    group["lr"] = lr

    def planted(name: str, write) -> Path:
        folder = tmp_path / name
        shutil.copytree(good, folder)
        write(folder)
        return folder

    cases = {
        planted("metadata", lambda f: (f / ".metadata").write_bytes(pickle.dumps(evil))): r"refusing (posix|os)\.system",
        tmp_path / "value": r"refusing the checkpoint value '.*lr'",
        planted("rng", lambda f: torch.save({"torch": evil}, f / "rng" / "rank_0.pt")): r"refusing .*rank_0\.pt.*system",
    }
    resumed = backend_factory(tiny_dense)
    for folder, message in cases.items():
        with pytest.raises(UnsafeCheckpointError, match=message):
            resumed.load_checkpoint(folder)
    assert not marker.exists()

    assert resumed.load_checkpoint(good) == {"note": "x"}
    for name, tensor in resumed.named_weights():
        assert torch.equal(tensor, saved[name]), name
