"""The plugin registers three transports and a config section; config reaches the transports."""

from __future__ import annotations

from pathlib import Path

import pytest
from miles.config import ConfigError, MilesConfig, load_config
from miles.kernel import Kernel
from miles.sections import RunSection, WeightsSection
from miles_weights.broadcast import BroadcastTransport
from miles_weights.disk import DiskTransport
from miles_weights.settings import WeightTransportSection
from miles_weights.shared_memory import SharedMemoryTransport


def test_registered_names_build_configured_transports(tmp_path: Path) -> None:
    registry = Kernel.load().weight_transports()
    assert {"disk", "shared_memory", "broadcast"} <= set(registry.names())
    # built directly: load_config would also validate every other section against plugins of other packages
    config = MilesConfig(weights=WeightsSection(bucket_mb=64, check=True), extra={"weight_transport": WeightTransportSection(
        pause_mode="retract", disk_dir=tmp_path, broadcast_backend="gloo")})
    expected = {"disk": DiskTransport, "shared_memory": SharedMemoryTransport, "broadcast": BroadcastTransport}
    for name, cls in expected.items():
        transport = registry.get(name)(config)
        try:
            assert isinstance(transport, cls)
            assert transport.options.bucket_bytes == 64 << 20 and transport.options.check
            assert transport.options.pause_mode == "retract"
        finally:
            transport.close()
    disk = registry.get("disk")(config)
    assert disk.directory == tmp_path.resolve()
    disk.close()
    with registry.get("broadcast")(config) as broadcast:
        assert broadcast.backend == "gloo" and broadcast.layout == "flattened_bucket"
    per_tensor = MilesConfig(extra={"weight_transport": WeightTransportSection(broadcast_format="per_tensor")})
    with registry.get("broadcast")(per_tensor) as broadcast:
        assert broadcast.layout == "per_tensor"


def test_disk_defaults_to_the_run_folder() -> None:
    config = MilesConfig(run=RunSection(output_dir=Path("/data/runs"), name="exp1"))
    disk = Kernel.load().weight_transports().get("disk")(config)
    assert disk.directory == Path("/data/runs/exp1/weight_sync")
    disk.close()


def test_bad_section_values_are_config_errors() -> None:
    # (the list also holds complaints about other sections while their plugins are missing)
    with pytest.raises(ConfigError, match="pause_mode"):
        load_config(None, ["weight_transport.pause_mode=sleep"])
    with pytest.raises(ConfigError, match="broadcast_format"):
        load_config(None, ["weight_transport.broadcast_format=zip"])
    with pytest.raises(ConfigError, match="weights.transport"):
        load_config(None, ["weights.transport=carrier_pigeon"])
