"""Nothing that arrives over a socket or from a folder a user names is unpickled unchecked: a
crafted payload is refused and runs nothing; disk updates stay inside the allowed folders."""

from __future__ import annotations

import base64
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from miles_contracts.wire.cuda_ipc import UnsafePayloadError, load_named_tensors
from miles_contracts.wire.tensors import deserialize_cuda_ipc, write_shm_bucket


class _Runs:
    """Pickles to a call of ``fn(*args)``: what an attacker puts in a payload."""

    def __init__(self, fn: object, *args: object) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return self.fn, self.args


def _payload(obj: object) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


def _fake_cuda_tensor(handle: bytes = b"h" * 64) -> _Runs:
    """The call torch's CUDA reduction writes for a tensor (``reduce_tensor``), with a made-up handle."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return _Runs(rebuild_cuda_tensor, torch.Tensor, torch.Size([2, 3]), (3, 1), 0, torch.storage.TypedStorage,
                 torch.float32, 0, handle, 24, 0, False, b"ref", 0, b"event", True)


def test_a_payload_that_calls_os_system_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    for evil in (_Runs(os.system, f"touch {marker}"), [("w", _Runs(os.system, f"touch {marker}"))],
                 [("w", _Runs(eval, f"open({str(marker)!r}, 'w')"))]):
        with pytest.raises(UnsafePayloadError, match="refusing"):
            deserialize_cuda_ipc(_payload(evil))
    assert not marker.exists()


def test_only_the_tensor_rebuild_is_admitted_and_its_arguments_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    # A class torch writes is an inert marker: calling it (to build a tensor of the payload's choice) fails.
    with pytest.raises(UnsafePayloadError):
        load_named_tensors(pickle.dumps([("w", _Runs(torch.Tensor, 10**12))]))
    with pytest.raises(UnsafePayloadError, match="refusing torch.serialization.load"):
        load_named_tensors(pickle.dumps([("w", _Runs(torch.load, "/etc/passwd"))]))
    with pytest.raises(UnsafePayloadError, match="IPC handles must be bytes"):
        load_named_tensors(pickle.dumps([("w", _fake_cuda_tensor(handle="not bytes"))]))  # type: ignore[arg-type]
    # The well-formed call reaches torch's rebuild_cuda_tensor with the real classes. There is no
    # GPU here, so torch's rebuild (which opens the IPC handle) is replaced by a recorder.
    seen = []
    well_formed = pickle.dumps([("w", _fake_cuda_tensor())])
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    monkeypatch.setattr("torch.multiprocessing.reductions.rebuild_cuda_tensor",
                        lambda *args: seen.append(args) or torch.zeros(2, 3))
    [(name, tensor)] = load_named_tensors(well_formed)
    assert name == "w" and tensor.shape == (2, 3)
    assert seen[0][0] is torch.Tensor and seen[0][4] is torch.storage.TypedStorage and seen[0][7] == b"h" * 64


def test_a_payload_cannot_rewrite_the_functions_it_is_allowed_to_call() -> None:
    """GLOBAL torch.Size, then BUILD with slot state: on a plain function this sets __defaults__
    (a change that outlives the request); the admitted callables refuse it."""
    from miles_contracts.wire import cuda_ipc

    payload = (b"\x80\x02ctorch\nSize\n" b"N}X\x0c\x00\x00\x00__defaults__K\x05K\x05\x86\x85s\x86b"
               b"0].")  # (None, {"__defaults__": ((5, 5),)}) applied to it, popped, then an empty list
    defaults = cuda_ipc._size.__defaults__
    with pytest.raises(UnsafePayloadError, match="may not modify"):
        load_named_tensors(payload)
    assert cuda_ipc._size.__defaults__ == defaults


def test_the_engine_refuses_a_crafted_tensor_update_and_keeps_serving(engine, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = _payload([("model.embed_tokens.weight", _Runs(os.system, f"touch {marker}"))])
    for load_format in ("cuda_ipc", None):  # CPU engine: cuda_ipc refused outright, the default is JSON
        body = {"serialized_named_tensors": [evil]} | ({"load_format": load_format} if load_format else {})
        answer = engine.client.post("/update_weights_from_tensor", json=body)
        assert answer.status_code == 400 and answer.json()["success"] is False, answer.text
    assert "needs an engine on CUDA" in engine.client.post(
        "/update_weights_from_tensor", json={"serialized_named_tensors": [evil], "load_format": "cuda_ipc"}).text
    assert not marker.exists()
    # the default format of a CPU engine is the shared-memory JSON layout
    name, tensor = next(iter(engine.target.loaded.model.state_dict().items()))
    bucket = write_shm_bucket([(name, tensor.clone())])
    try:
        ok = engine.client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [json.dumps(bucket.to_json())]})
    finally:
        Path(bucket.path).unlink()
    assert ok.status_code == 200 and ok.json()["success"], ok.text


def test_disk_updates_stay_inside_the_allowed_folders(engine, tmp_path_factory: pytest.TempPathFactory) -> None:
    allowed = tmp_path_factory.getbasetemp() / "allowed"
    outside = tmp_path_factory.mktemp("outside")
    for path in (outside, "/etc", f"{allowed}/../{outside.name}"):
        answer = engine.client.post("/update_weights_from_disk", json={"model_path": str(path)})
        assert answer.status_code == 400 and "outside the folders" in answer.json()["message"], answer.text
    # an index inside an allowed folder that names shards elsewhere
    folder = allowed / "escape"
    folder.mkdir(parents=True)
    (outside / "model.safetensors").write_bytes(b"")
    for shard in ("../../outside0/model.safetensors", str(outside / "model.safetensors")):
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": shard}}))
        answer = engine.client.post("/update_weights_from_disk", json={"model_path": str(folder)})
        assert answer.status_code == 400 and "shard" in answer.json()["message"], answer.text
    (folder / "model.safetensors").symlink_to(outside / "model.safetensors")
    (folder / "model.safetensors.index.json").unlink()
    answer = engine.client.post("/update_weights_from_disk", json={"model_path": str(folder)})
    assert answer.status_code == 400 and "outside the folder" in answer.json()["message"], answer.text


def test_resume_refuses_a_checkpoint_whose_pickles_would_run_code(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from miles.trainer.safe_checkpoint import (
        SafeFileSystemReader,
        SafeLoadPlanner,
        UnsafeCheckpointError,
        refusals_surface,
    )

    marker = tmp_path / "pwned"
    state = {"w": torch.arange(4.0), "lr": 0.1}
    good = tmp_path / "good"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(good)))
    loaded = {"w": torch.zeros(4), "lr": 0.0}
    dcp.load(loaded, storage_reader=SafeFileSystemReader.checked(good), planner=SafeLoadPlanner())
    assert loaded["lr"] == 0.1 and torch.equal(loaded["w"], torch.arange(4.0))

    # a .metadata that runs a command when unpickled
    (good / ".metadata").write_bytes(pickle.dumps(_Runs(os.system, f"touch {marker}")))
    with pytest.raises(UnsafeCheckpointError, match=r"refusing (posix|os)\.system"):
        SafeFileSystemReader.checked(good)
    # a state value that does
    bad = tmp_path / "bad"
    dcp.save({"w": torch.zeros(1), "x": _Runs(os.system, f"touch {marker}")}, storage_writer=dcp.FileSystemWriter(str(bad)))
    with pytest.raises(UnsafeCheckpointError, match="refusing the checkpoint value 'x'"), refusals_surface():
        dcp.load({"w": torch.zeros(1), "x": None}, storage_reader=SafeFileSystemReader.checked(bad), planner=SafeLoadPlanner())
    assert not marker.exists()


def test_checkpoint_metadata_cannot_rewrite_the_classes_it_names(tmp_path: Path) -> None:
    """GLOBAL of an admitted class, then BUILD with slot state: ``setattr`` on the class itself (a
    plain unpickler sets ``StorageMeta.load_id`` for the rest of the process). The metadata reader
    builds instances only."""
    from miles.trainer.safe_checkpoint import UnsafeCheckpointError, read_dcp_metadata
    from torch.distributed.checkpoint.metadata import StorageMeta

    path = tmp_path / ".metadata"
    path.write_bytes(b"\x80\x02ctorch.distributed.checkpoint.metadata\nStorageMeta\n"
                     b"N}X\x07\x00\x00\x00load_idK\x05s\x86b.")  # (None, {"load_id": 5}) applied to the class
    before = StorageMeta.__dict__.get("load_id")
    with pytest.raises(UnsafeCheckpointError, match="refusing to set attributes of .*StorageMeta"):
        read_dcp_metadata(path)
    assert StorageMeta.__dict__.get("load_id") == before
