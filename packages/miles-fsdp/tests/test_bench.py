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
    assert miles["mfu"] == pytest.approx(miles["tflops"] / 1.0) and report["devices"] == 1
    profile = tmp_path / "prof" / "profile-fsdp-L64.txt"
    assert miles["profile"] == str(profile) and miles["profiled_step_s"] > 0
    text = profile.read_text()
    assert "one step under the profiler" in text and "aten::mm" in text  # the model's matmuls are in the table
    assert miles["kernel_s"] is None  # no device kernels on the CPU


def test_rates_are_per_device_when_ranks_share_a_step() -> None:
    from miles_fsdp.bench import _rates

    # 8 TFLOP in 2 s on two devices of peak 4 TFLOP/s each: 2 TFLOP/s per device, half the peak
    shared = _rates({"step_s": 2.0}, tokens=100, flops=8e12, peak_tflops=4.0, devices=2)
    assert shared["tokens_per_s"] == 50.0 and shared["tflops"] == pytest.approx(2.0) and shared["mfu"] == pytest.approx(0.5)
    assert _rates({"step_s": 2.0}, tokens=100, flops=8e12, peak_tflops=4.0)["mfu"] == pytest.approx(1.0)
