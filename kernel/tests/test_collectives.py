"""``miles.trainer.collectives`` over a real two-rank gloo group (two processes)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

_WORKER = textwrap.dedent("""
    import json, sys
    import torch.distributed as dist
    from miles.trainer.collectives import all_gather_json, sum_over_ranks

    rank, store_file, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)

    def refuse(*_a, **_k):
        raise AssertionError("pickling collective used")

    # nothing may go through torch's pickling object collectives
    dist.all_gather_object = dist.broadcast_object_list = dist.gather_object = refuse
    mine = {"rank": rank, "name": "é" * (rank * 50), "shape": [3, rank]} if rank else []
    gathered = all_gather_json(mine)
    metrics = {"loss": 1.5, "only_rank0": 2.0} if rank == 0 else {"loss": 0.25}
    summed = sum_over_ranks(metrics)
    idle = sum_over_ranks({} if rank == 0 else {"x": 1.0})  # an idle rank (no keys) gets the others' names
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"gathered": gathered, "summed": summed, "idle": idle}, f)
""")


def test_all_gather_json_and_sum_over_ranks_on_two_ranks(tmp_path: Path) -> None:
    import subprocess

    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), str(store), str(tmp_path / f"out{rank}.json")])
             for rank in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    results = [json.loads((tmp_path / f"out{rank}.json").read_text()) for rank in range(2)]
    expected = [[], {"rank": 1, "name": "é" * 50, "shape": [3, 1]}]
    for result in results:
        assert result["gathered"] == expected  # rank order, unequal lengths, non-ASCII
        assert result["summed"] == {"loss": 1.75, "only_rank0": 2.0}
    assert results[0]["idle"] == results[1]["idle"] == {"x": 1.0}


def test_one_rank_needs_no_group() -> None:
    from miles.trainer.collectives import all_gather_json, sum_over_ranks

    assert all_gather_json((1, "a")) == [[1, "a"]]
    assert sum_over_ranks({"b": 1.0, "a": 2.0}) == {"a": 2.0, "b": 1.0}
