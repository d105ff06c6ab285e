"""``miles bench train`` on the CPU: the report's shape, and ``--profile``'s op tables."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_bench_train_reports_rates_and_writes_a_profile(tmp_path) -> None:
    from miles_fsdp.bench import run_benchmark

    report = run_benchmark(preset="tiny", seq_lens=[64], tokens_per_step=128, warmup=1, steps=1, device="cpu",
                           gradient_checkpointing=False, options={"compile": False}, baseline=False, peak_tflops=1.0,
                           profile_dir=tmp_path / "prof")
    (entry,) = report["results"]
    assert (entry["seq_len"], entry["rows"], entry["tokens_per_step"]) == (64, 2, 128)
    miles = entry["miles"]
    assert miles["step_s"] > 0 and miles["tokens_per_s"] == pytest.approx(128 / miles["step_s"])
    assert miles["mfu"] == pytest.approx(miles["tflops"] / 1.0)
    profile = tmp_path / "prof" / "profile-fsdp-L64.txt"
    assert miles["profile"] == str(profile) and miles["profiled_step_s"] > 0
    text = profile.read_text()
    assert "one step under the profiler" in text and "aten::mm" in text  # the model's matmuls are in the table
    assert miles["kernel_s"] is None  # no device kernels on the CPU
