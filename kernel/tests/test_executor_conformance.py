"""The executor conformance suite (``miles_contracts.testing.executor``) against ``local``, built
as a run builds it: the registered ``ExecutorSpec`` given a ``RunContext`` with a run folder.

Only the plugins the executor needs are loaded (the whole set imports torch, for seconds).
"""

from __future__ import annotations

from pathlib import Path

from miles.config import ExecutorSection, MilesConfig
from miles.context import context_for
from miles.kernel import Kernel
from miles.plugins import PluginSelection
from miles_contracts import Executor
from miles_contracts.testing.executor import check_executor


def _local(run_dir: Path) -> Executor:
    kernel = Kernel.load(PluginSelection(enable=("core", "executors")))
    ctx = context_for(MilesConfig(executor=ExecutorSection()), run_dir=run_dir, kernel=kernel)
    return kernel.executors().get("local").create(ctx)


def test_local_executor_meets_the_executor_contract(tmp_path: Path) -> None:
    # local's supervise looks every second: 2.5 s are enough to see a death reported twice
    check_executor(_local, tmp_path / "run", quiet=2.5)
