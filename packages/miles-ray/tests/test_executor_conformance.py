"""The executor conformance suite (``miles_contracts.testing.executor``) against ``ray``, on the
session's Ray cluster (conftest: a head and two worker nodes, all on this machine; started once).

The executor is built as a run builds it (the registered ``ExecutorSpec`` given a ``RunContext``)
and joins the cluster as a driver; the suite's processes run on the driver's node, without GPUs.
Logs are copied and deaths looked for often, so the suite's generous waits are short in practice.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from miles.config import ExecutorSection, MilesConfig
from miles.context import context_for
from miles.kernel import Kernel
from miles.plugins import PluginSelection
from miles_contracts import Executor
from miles_contracts.testing.executor import check_executor
from miles_ray.config import RaySection
from ray_support import GPU, RAY_ENV

pytestmark = pytest.mark.slow

SUPERVISE_INTERVAL = 0.5
QUIET = 4 * SUPERVISE_INTERVAL


@pytest.fixture
def make_ray(ray_cluster, monkeypatch):
    for key, value in RAY_ENV.items():  # the driver joins the cluster with the settings its nodes have
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    section = RaySection(address=ray_cluster.address, gpu_resource=GPU, log_interval=0.2,
                         supervise_interval=SUPERVISE_INTERVAL)

    def make(run_dir: Path) -> Executor:
        kernel = Kernel.load(PluginSelection(enable=("core", "executors", "ray")))
        config = MilesConfig(executor=ExecutorSection(name="ray"), extra={"ray": section})
        return kernel.executors().get("ray").create(context_for(config, run_dir=run_dir, kernel=kernel))

    return make


def test_ray_executor_meets_the_executor_contract(make_ray, tmp_path: Path) -> None:
    """Every check, supervision and unique names included. Both failed before: a watcher that
    polled between ``launch`` registering a process and its host spawning it took the host's
    "unknown" for a death (and, reports being keyed by restarts, then missed the first real one);
    ``launch`` silently replaced a running process of the same name."""
    check_executor(make_ray, tmp_path / "run", quiet=QUIET)
