"""The wandb tracker in offline mode: no network, files under the run folder, read back here."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest
from miles.config import MilesConfig
from miles.context import context_for
from miles.kernel import Kernel
from miles.plugins import PluginSelection, load_plugins
from miles.sections import RunSection, TrackingSection
from miles.tracking import open_trackers
from miles_contracts import Process, RunContext
from miles_tracker_wandb.config import WandbSection

BLOCK = 32768  # W&B's run file is a LevelDB-style log: 32 KiB blocks of (crc, length, type) records
HEADER = 7  # ":W&B" + magic (2 bytes) + version (1 byte)


def read_history(run_file: Path) -> list[dict[str, float]]:
    """Every history row (``run.log`` call) stored in an offline ``run-<id>.wandb`` file.

    wandb-core writes the file in the background and ``run.finish()`` can return before it is
    complete, so this waits (up to a minute) for the run's final ``exit`` record.
    """
    deadline = time.monotonic() + 60
    while True:
        rows, finished = parse_run_file(run_file)
        if finished or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def parse_run_file(run_file: Path) -> tuple[list[dict[str, float]], bool]:
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    if len(data) < HEADER:
        return [], False
    assert data[:4] == b":W&B", f"{run_file} is not a W&B run file"
    rows, pending, offset = [], b"", HEADER
    while offset + 7 <= len(data):
        if BLOCK - offset % BLOCK < 7:  # block trailer too small for a record header: padding
            offset += BLOCK - offset % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        chunk, offset = data[offset + 7 : offset + 7 + length], offset + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (2, 3):  # first / middle fragment: the record continues
            continue
        record = wandb_internal_pb2.Record.FromString(pending)
        if record.WhichOneof("record_type") == "history":
            rows.append({"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item})
        if record.WhichOneof("record_type") == "exit":
            return rows, True
    return rows, False


@pytest.fixture
def kernel() -> Kernel:
    selection = PluginSelection(enable=("wandb", "trackers"))
    return Kernel(load_plugins(selection), selection)


def miles_config() -> MilesConfig:
    return MilesConfig(
        run=RunSection(name="offline-demo"),
        tracking=TrackingSection(trackers=["wandb"], project="miles-tests"),
        extra={"wandb": WandbSection(mode="offline", tags=["test"])},
    )


def driver(kernel: Kernel, run_dir: Path) -> RunContext:
    """The driver's context of the run in ``run_dir`` (where trackers start)."""
    return context_for(miles_config(), Process.driver(), run_dir=run_dir, kernel=kernel)


def test_offline_run_writes_every_step_under_the_run_folder(kernel: Kernel, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "")  # no credentials, no network: offline must not need them
    logger = open_trackers(driver(kernel, tmp_path))
    for step in (1, 2, 3):
        logger.log({"reward/mean": step / 4, "eval/pass@1": 0.5}, step=step)
    logger.close()

    run_id = (tmp_path / "wandb-run-id").read_text()
    [run_file] = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    rows = read_history(run_file)
    assert [(r["_step"], r["reward/mean"], r["eval/pass@1"]) for r in rows] == [(1, 0.25, 0.5), (2, 0.5, 0.5), (3, 0.75, 0.5)]


def test_a_resumed_run_continues_the_same_wandb_run(kernel: Kernel, tmp_path: Path) -> None:
    first = open_trackers(driver(kernel, tmp_path))
    first.log({"x": 1.0}, step=1)
    first.close()
    run_id = (tmp_path / "wandb-run-id").read_text()
    # W&B names an offline run folder by the second it starts (offline-run-YYYYmmdd_HHMMSS-<id>); a
    # real resume comes much later, here the second run must not start in the same second.
    time.sleep(1.05 - time.time() % 1)
    again = open_trackers(driver(kernel, tmp_path))
    again.log({"x": 2.0}, step=2)
    again.close()
    assert (tmp_path / "wandb-run-id").read_text() == run_id
    runs = sorted((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    steps = [row["_step"] for run in runs for row in read_history(run / f"run-{run_id}.wandb")]
    assert steps == [1, 2]
