"""``miles bench weights`` end to end on the tiny model, and the random models it can build."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from miles.context import context_for
from miles_weights import bench_models
from miles_weights.bench_models import LlamaShape, load_tensors, random_llama


@pytest.mark.slow
def test_the_benchmark_measures_every_transport_against_memcpy(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "weights.json"
    command = [sys.executable, "-m", "miles.cli.main", "bench", "weights", "--model", str(tiny_dir), "--devices", "cpu",
               "--repeats", "1", "--bucket-mb", "1", "--work-dir", str(tmp_path / "work"), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(done.stdout) == result
    (run,) = result["runs"]
    assert run["device"] == "cpu" and run["num_bytes"] == sum(t.numel() * 4 for _, t in load_tensors(tiny_dir, torch.float32, "cpu"))
    expected = {"disk", "shared_memory", "broadcast", "broadcast/per_tensor"}
    if "mooncake" in context_for().kernel.weight_transports():
        expected.add("mooncake")
    assert set(run["transports"]) == expected
    for name, measured in run["transports"].items():
        assert measured["check"] == "bit-exact", name
        assert measured["baseline"] == "memcpy"
        assert measured["ratio_to_baseline"] == pytest.approx(measured["gbps_best"] / run["baselines_gbps"]["memcpy"])
    disk_dir = tmp_path / "work" / "cpu" / "disk"
    assert not disk_dir.exists() or list(disk_dir.iterdir()) == []  # the disk transport cleaned up after itself


def test_random_llama_is_a_model_transformers_loads(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setitem(bench_models.RANDOM_MODELS, "test", LlamaShape(hidden=64, intermediate=96, layers=2, heads=4, kv_heads=2))
    folder = random_llama("test", tiny_dir, tmp_path)
    assert random_llama("test", tiny_dir, tmp_path) == folder  # built once
    model = AutoModelForCausalLM.from_pretrained(folder)
    ours = dict(load_tensors(folder, torch.bfloat16, "cpu"))
    theirs = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied to the embedding
    assert set(ours) == set(theirs)
    assert all(ours[k].shape == theirs[k].shape for k in ours)
    assert (folder / "tokenizer.json").is_file()


def test_broadcast_is_measured_in_each_layout_asked_for() -> None:
    from miles_weights.bench import _variants

    assert _variants(["disk", "broadcast"], ["flattened_bucket", "per_tensor"]) == [
        ("disk", "disk", {}),
        ("broadcast", "broadcast", {"broadcast_format": "flattened_bucket"}),
        ("broadcast/per_tensor", "broadcast", {"broadcast_format": "per_tensor"}),
    ]
    assert _variants(["broadcast"], ["per_tensor"]) == [("broadcast/per_tensor", "broadcast", {"broadcast_format": "per_tensor"})]
    with pytest.raises(SystemExit, match="--broadcast-formats takes flattened_bucket and/or per_tensor; got 'zip'"):
        _variants(["broadcast"], ["zip"])


def test_flags_take_defaults_choices_and_bounds_from_the_config_keys() -> None:
    import argparse

    from miles.sections import WeightsSection
    from miles_weights.bench import add_arguments, run
    from miles_weights.settings import BROADCAST_LAYOUTS

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert args.bucket_mb == WeightsSection().bucket_mb
    assert args.broadcast_formats.split(",") == list(BROADCAST_LAYOUTS)
    assert "weights.bucket_mb" in parser.format_help() and "weight_transport.broadcast_format" in parser.format_help()
    with pytest.raises(SystemExit, match=r"--bucket-mb: .*weights\.bucket_mb: Input should be greater than or equal to 1"):
        run(parser.parse_args(["--bucket-mb", "0"]), context_for())
