"""`miles train` on the ``ray`` executor over a real 2-node Ray cluster on this machine.

The cluster (conftest) has a head with 2 stand-in GPUs (the custom resource ``miles_gpu``) and
two more nodes with 1 each. Disaggregated, 2 trainer ranks and 1 engine take 3 of them: the ranks on
the head (the first node), the engine on another node. Mid-run (step 2's scoring held by a reward
server, conftest's ``RewardGate``) the engine's node is killed the way a machine dies; Ray places its bundle on the node left, the engine comes back there, the router
follows it, and the run finishes. Afterwards no process of the run is left on any node.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from miles_contracts.testing.processes import LoggedProcess, wait_ready
from ray_support import GPU, RAY_ENV

pytestmark = pytest.mark.slow


def _train(cluster, model: Path, out: Path, name: str, *extra: str) -> LoggedProcess:
    args = [f"model.name={model}", f"run.output_dir={out}", f"run.name={name}", "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=4", "rollout.max_new_tokens=12", "reward.name=f1", "data.options={digits: 1}",
            "executor.name=ray", f"ray.address={cluster.address}", f"ray.gpu_resource={GPU}", *extra]
    env = {**RAY_ENV, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return LoggedProcess([sys.executable, "-m", "miles.cli.main", "train", *args], out / f"{name}.out", env=env).start()


def _metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
                alive.append(pid)
        except OSError:
            pass
    return alive


def test_trainer_on_one_node_engine_on_another_and_a_lost_node_comes_back(ray_cluster, tiny_model, tmp_path,
                                                                          reward_gate) -> None:
    run = tmp_path / "nodes"
    proc = _train(ray_cluster, tiny_model, tmp_path, "nodes", "run.steps=3", "resources.trainer_ranks=2",
                  "resources.colocate=false", "weights.transport=broadcast", "reward.name=remote",
                  f"reward.remote_url={reward_gate.url}")
    try:
        # step 2's scoring is held: its generation is done, its training and weight sync are not
        proc.wait_ready(reward_gate.reached.is_set, "step 2's scoring request at the reward server")
        assert [m["step"] for m in _metrics(run)] == [1]
        before = {row["name"]: row for row in json.loads((run / "services.json").read_text())}
        # bundles in (node, GPU) order, the head first: both ranks on the head, the engine elsewhere
        assert before["trainer-0"]["node_name"] == before["trainer-1"]["node_name"] == "head"
        lost = before["engine-0"]["node_name"]
        assert lost in ("a", "b") and before["router"]["node_name"] == "head"
        # every process's log reached the run folder, whichever node it ran on
        assert "miles engine:" in (run / "logs" / "engine-0.log").read_text()
        assert (run / "logs" / "trainer-1.log").is_file()

        # the engine's node dies, with every process on it; the other worker has room for its bundle.
        # Step 2's weight sync finds the engine gone and pushes again once it is back elsewhere.
        ray_cluster.kill(lost, also=[before["engine-0"]["pid"], before["engine-0"]["host_pid"]])
        reward_gate.released.set()
        proc.wait_exit("the run to finish after the loss of a node")
    finally:
        proc.stop()
    output = proc.output()
    assert proc.returncode == 0, output[-5000:]
    metrics = _metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["weights/version"] for m in metrics] == [1.0, 2.0, 3.0]
    assert [m["weights/engines_restarted"] for m in metrics] == [0.0, 1.0, 0.0]
    after = {row["name"]: row for row in json.loads((run / "services.json").read_text())}
    assert after["engine-0"]["restarts"] == 1 and after["engine-0"]["node_name"] not in (lost, "head")
    assert "run completed" in output

    pids = [row[key] for row in after.values() for key in ("pid", "host_pid") if row.get(key)]
    wait_ready(lambda: not _alive(pids), f"the run's processes {pids} to end", deadline_s=120)
