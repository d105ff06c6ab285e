"""The tensorboard tracker writes event files that hold exactly the logged scalars."""

from __future__ import annotations

import struct
from pathlib import Path

from miles.config import MilesConfig
from miles.context import context_for
from miles.kernel import Kernel
from miles.plugins import PluginSelection, load_plugins
from miles.sections import TrackingSection
from miles.tracking import open_trackers
from miles_contracts import Process


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Parse the TFRecord event files TensorBoard reads: (length, crc, event proto, crc) records."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_logged_steps_read_back_from_the_event_files(tmp_path: Path) -> None:
    selection = PluginSelection(enable=("tensorboard", "trackers"))
    kernel = Kernel(load_plugins(selection), selection)
    config = MilesConfig(tracking=TrackingSection(trackers=["tensorboard"]))
    logger = open_trackers(context_for(config, Process.driver(), run_dir=tmp_path, kernel=kernel))
    assert logger.names == ["jsonl", "tensorboard"]
    for step in (1, 2, 3):
        logger.log({"reward/mean": step / 4, "eval/pass@1": 0.5 if step == 2 else float("nan")}, step=step)
    logger.close()
    scalars = read_scalars(tmp_path / "tensorboard")
    assert scalars["reward/mean"] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    # tensorboardX makes tags safe for TensorFlow ('@' becomes '_'); non-finite values are not written
    assert scalars["eval/pass_1"] == [(2, 0.5)]
