"""The plugin registers three transports and a config section; config reaches the transports."""

from __future__ import annotations

from pathlib import Path

import pytest
from miles.config import ConfigError, MilesConfig, load_config
from miles.context import context_for
from miles.sections import WeightsSection
from miles_contracts import Process, RunContext
from miles_weights.broadcast import BroadcastTransport
from miles_weights.disk import DiskTransport
from miles_weights.settings import WeightTransportSection
from miles_weights.shared_memory import SharedMemoryTransport
from miles_weights.sync import TransportOptions


def rank0(config: MilesConfig, run_dir: Path | None = None) -> RunContext:
    """Trainer rank 0 of a run of ``config``: where a run creates its weight transport."""
    return context_for(config, Process.trainer_rank(0), run_dir=run_dir)


def test_registered_names_build_configured_transports(tmp_path: Path) -> None:
    # built directly: load_config would also validate every other section against plugins of other packages
    config = MilesConfig(weights=WeightsSection(bucket_mb=64, check=True), extra={"weight_transport": WeightTransportSection(
        pause_mode="retract", disk_dir=tmp_path, broadcast_backend="gloo")})
    ctx = rank0(config)
    registry = ctx.kernel.weight_transports()
    assert {"disk", "shared_memory", "broadcast"} <= set(registry.names())
    # CUDA IPC: only shared_memory needs each engine on its pushing rank's GPU
    assert [name for name in ("disk", "shared_memory", "broadcast") if registry.get(name).needs_shared_gpu] == ["shared_memory"]
    expected = {"disk": DiskTransport, "shared_memory": SharedMemoryTransport, "broadcast": BroadcastTransport}
    for name, cls in expected.items():
        transport = registry.get(name).create(ctx)
        try:
            assert isinstance(transport, cls)
            assert transport.options.bucket_bytes == 64 << 20 and transport.options.check
            assert transport.options.pause_mode == "retract"
        finally:
            transport.close()
    disk = registry.get("disk").create(ctx)
    assert disk.directory == tmp_path.resolve()
    disk.close()
    with registry.get("broadcast").create(ctx) as broadcast:
        assert broadcast.backend == "gloo" and broadcast.layout == "flattened_bucket"
    per_tensor = MilesConfig(extra={"weight_transport": WeightTransportSection(broadcast_format="per_tensor")})
    with registry.get("broadcast").create(rank0(per_tensor)) as broadcast:
        assert broadcast.layout == "per_tensor"


def test_disk_defaults_to_the_run_folder(tmp_path: Path) -> None:
    ctx = rank0(MilesConfig(), run_dir=tmp_path / "runs" / "exp1")
    disk = ctx.kernel.weight_transports().get("disk").create(ctx)
    assert disk.directory == (tmp_path / "runs" / "exp1" / "weight_sync").resolve()
    disk.close()
    outside = rank0(MilesConfig())  # no run folder (a benchmark) and no weight_transport.disk_dir
    with pytest.raises(ValueError, match="weight_transport.disk_dir needs a run folder"):
        outside.kernel.weight_transports().get("disk").create(outside)


def test_options_follow_the_sections_that_declare_them() -> None:
    """TransportOptions copies its fields from ``weights`` / ``weight_transport``: same defaults,
    same bounds, and an error names the config key to fix."""
    defaults, weights, section = TransportOptions(), WeightsSection(), WeightTransportSection()
    assert (defaults.bucket_mb, defaults.check) == (weights.bucket_mb, weights.check)
    assert (defaults.pause_mode, defaults.http_timeout, defaults.check_seed) == (
        section.pause_mode, section.http_timeout, section.check_seed)
    with pytest.raises(ValueError, match=r"weights\.bucket_mb: Input should be greater than or equal to 1 \(got 0\)"):
        TransportOptions(bucket_mb=0)
    with pytest.raises(ValueError, match=r"weight_transport\.http_timeout: Input should be greater than 0"):
        TransportOptions(http_timeout=0)
    with pytest.raises(ValueError, match=r"weight_transport\.pause_mode: Input should be 'abort', 'retract' or 'in_place'"):
        TransportOptions(pause_mode="sleep")
    config = MilesConfig(weights=WeightsSection(bucket_mb=8, check=True),
                         extra={"weight_transport": WeightTransportSection(pause_mode="in_place", http_timeout=5, check_seed=3)})
    assert TransportOptions.from_config(config) == TransportOptions(bucket_mb=8, check=True, pause_mode="in_place",
                                                                     http_timeout=5, check_seed=3)
    with pytest.raises(ValueError, match="broadcast_backend"):
        BroadcastTransport(backend="mpi")


def test_bad_section_values_are_config_errors() -> None:
    # (the list also holds complaints about other sections while their plugins are missing)
    with pytest.raises(ConfigError, match="pause_mode"):
        load_config(None, ["weight_transport.pause_mode=sleep"])
    with pytest.raises(ConfigError, match="broadcast_format"):
        load_config(None, ["weight_transport.broadcast_format=zip"])
    with pytest.raises(ConfigError, match="weights.transport"):
        load_config(None, ["weights.transport=carrier_pigeon"])
