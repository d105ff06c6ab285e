"""`miles train train.backend=megatron` end to end on CPU with the tiny random Llama: the real
engine, router, megatron backend in trainer rank processes (one; or two at TP=2, the trainer-ranks
handle of the loop), weight sync in check mode and a checkpoint, as the local executor starts them."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from miles_contracts.testing.processes import LoggedProcess

LAYOUTS = {"one-rank": [], "tp2": ["resources.trainer_ranks=2", "megatron.tensor_parallel=2"]}


@pytest.fixture(scope="module")
def runs(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, LoggedProcess]]]:
    """One run per layout, started together (own folders, ranks and ports: their start-ups overlap);
    each layout's test waits for its own. Run folder and process by layout."""
    started: dict[str, tuple[Path, LoggedProcess]] = {}
    try:
        for name, layout in LAYOUTS.items():
            out = tmp_path_factory.mktemp(name)
            args = [*layout,
                f"model.name={tiny_dense}", f"run.output_dir={out}", "run.name=mg", "run.steps=2",
                "train.backend=megatron", "weights.check=true", "rollout.prompts_per_step=2",
                "rollout.samples_per_prompt=4", "rollout.max_new_tokens=12", "reward.name=f1", "data.options={digits: 1}",
            ]
            process = LoggedProcess([sys.executable, "-m", "miles.cli.main", "train", *args], out / "train.out",
                                    env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
            started[name] = out / "mg", process.start()
        yield started
    finally:
        for _, process in started.values():
            process.stop()


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_train_with_the_megatron_backend(runs: dict[str, tuple[Path, LoggedProcess]], layout: str) -> None:
    run, process = runs[layout]
    output = process.finished(f"the {layout} run to finish", deadline_s=900)  # raises unless its status is 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        # fp32 engine vs fp32 megatron trainer on the same weights: log-probs agree to rounding
        assert m["train/train_rollout_logprob_abs_diff"] < 1e-3
        assert m["train/optimizer_steps"] >= 1
    assert [m["weights/version"] for m in metrics] == [1.0, 2.0]
    assert [m["weights/check_passed"] for m in metrics] == [1.0, 1.0]
    assert (run / "checkpoints" / "step_000002" / "miles-state.json").is_file()
    assert "run completed" in output
    # the ranks split the model as asked (not, say, two data-parallel replicas)
    trainer_state = json.loads((run / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert ("tp=2" if layout == "tp2" else "tp=1") in trainer_state["layout"]
    services = json.loads((run / "services.json").read_text())
    ranks = 2 if layout == "tp2" else 1
    assert [s["name"] for s in services if s["name"].startswith("trainer")] == [f"trainer-{r}" for r in range(ranks)]
