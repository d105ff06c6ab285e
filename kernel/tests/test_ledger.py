"""The sample ledger (``miles.loop.ledger``) through the loop's real parts: the RolloutManager,
a JSONL data source, the filters and the fully_async workers and buffer, writing real files in
the run folder; ``miles ledger`` reads them back.

The generator is a test plugin that answers at once (no engine: these tests are about what the
loop records, the engine plays no part in it); its reward gives the groups of even data records
variance and the odd ones none, so ``zero_variance`` drops exactly the odd ones.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from miles import hookimpl
from miles.cli.main import main
from miles.config import MilesConfig
from miles.context import context_for
from miles.data.errors import DataError
from miles.data.source import open_data_source
from miles.kernel import Kernel
from miles.loop.buffer import GroupBuffer
from miles.loop.ledger import EPOCHS_FILE, EVENTS_FILE, LEDGER_DIR, Ledger, LedgerError, summarize
from miles.loop.modes.fully_async import filter_pipeline
from miles.loop.producer import RolloutWorkers
from miles.loop.rollout import RolloutManager
from miles.plugins import PluginSelection
from miles.sections import DataSection, RewardSection, RolloutSection, RunSection
from miles_contracts import ExitReason, GeneratorSpec, RewardSpec, Sample, Status

RECORDS = 4


async def answer(sample: Sample, ctx: object) -> Sample:
    sample.tokens, sample.response_length, sample.loss_mask = [1, 2, 3], 1, [1]
    sample.response, sample.weight_versions, sample.rollout_logprobs = "x", [0], [0.0]
    return sample.finish(Status.COMPLETED, ExitReason.STOP)


def even_records_vary(samples: list[Sample]) -> list[float]:
    return [float(s.index % 2) if s.metadata["data_index"] % 2 == 0 else 0.0 for s in samples]


class Answers:
    @hookimpl
    def miles_register_generators(self, register):
        register("answer", GeneratorSpec(answer))

    @hookimpl
    def miles_register_rewards(self, register):
        register("even_records_vary", RewardSpec(even_records_vary))


def _manager(tmp_path: Path, *, mode: str = "sync", filters: tuple[str, ...] = (), run_dir: Path | None = None,
             ledger: Ledger | None = None, samples_per_prompt: int = 2, on_error: str = "skip",
             source: str = "jsonl") -> RolloutManager:
    data = tmp_path / "prompts.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"prompt": f"question {i}", "label": str(i)}) + "\n" for i in range(RECORDS)))
    Kernel.clear_cache()  # a resumed run loads its kernel anew
    kernel = Kernel.load(PluginSelection(enable=("core", "data", "filters", "generators", "rewards")))
    kernel.register_plugin(Answers(), "answers")
    config = MilesConfig(run=RunSection(mode=mode),
                         rollout=RolloutSection(generator="answer", prompts_per_step=2,
                                                samples_per_prompt=samples_per_prompt, concurrency=4,
                                                filters=list(filters)),
                         reward=RewardSection(name="even_records_vary"),
                         data=DataSection(source=source, path=str(data) if source == "jsonl" else None, seed=3,
                                          on_error=on_error))
    ctx = context_for(config, kernel=kernel)
    source = open_data_source(ctx)
    ledger = ledger if ledger is not None else Ledger(run_dir or tmp_path / "run", RECORDS)
    return RolloutManager(ctx, source, engine=None, tokenizer=None, ledger=ledger)


def _generated(manager: RolloutManager, groups: list[list[Sample]]) -> list[list[Sample]]:
    """``groups`` generated and scored (trainable)."""
    from miles.rewards import score_samples

    samples = [s for g in groups for s in g]
    asyncio.run(manager.generate(samples, manager.context()))
    asyncio.run(score_samples(samples, manager.run))
    return groups


def _sync_steps(manager: RolloutManager, steps: range) -> None:
    assert manager.ledger is not None
    for step in steps:
        rollout = asyncio.run(manager.collect(step))
        manager.ledger.record_batch(step, rollout.groups)


def test_a_sync_run_trains_or_filters_every_prompt_of_each_epoch_once(fresh_kernels: None, tmp_path: Path) -> None:
    """Four steps of two prompts over four records (the over-sampler draws more as the filter
    drops half): each closed epoch's prompts are trained (even records) or filtered by
    zero_variance with that reason (odd ones), exactly once."""
    (tmp_path / "run").mkdir()
    manager = _manager(tmp_path, filters=("zero_variance",))
    assert manager.ledger is not None
    manager.ledger.begin(None, 0)
    _sync_steps(manager, range(1, 5))
    report = summarize(tmp_path / "run")
    closed = [e for e in report["epochs"] if e["closed"]]
    assert len(closed) >= 2 and all(e["prompts"] == RECORDS for e in closed)
    assert all((e["trained"], e["filtered"], e["dropped"]) == (2, {"zero_std": 2}, {}) for e in closed[:-1])
    assert (report["lost"], report["duplicated"]) == (0, 0)
    # the trained ones are the even records, each once per epoch: read from the lines themselves
    lines = [json.loads(x) for x in (tmp_path / "run" / LEDGER_DIR / EVENTS_FILE).read_text().splitlines()]
    drawn = {line["group"]: (line["epoch"], line["data_index"]) for line in lines if line.get("state") == "drawn"}
    trained = sorted(drawn[line["group"]] for line in lines if line.get("state") == "trained")
    assert trained[:4] == [(0, 0), (0, 2), (1, 0), (1, 2)]
    assert main(["ledger", str(tmp_path / "run")]) == 0


def test_fully_async_workers_record_every_group_and_a_completed_run_settles_the_rest(
        fresh_kernels: None, tmp_path: Path) -> None:
    """The workers draw, generate and hand groups to the buffer, which records what its filter
    dropped; the trainer's batches are recorded trained; at the end what was never taken is
    dropped with a reason, and nothing is lost or duplicated."""
    (tmp_path / "run").mkdir()
    manager = _manager(tmp_path, mode="fully_async", filters=("zero_variance",))
    ledger = manager.ledger
    assert ledger is not None
    ledger.begin(None, 0)
    buffer = GroupBuffer(2, admit=filter_pipeline(["zero_variance"], manager.kernel), ledger=ledger)
    workers = RolloutWorkers(manager, buffer, version=lambda: 0)

    async def scenario() -> None:
        workers.start()
        try:
            for step in (1, 2, 3):
                ledger.record_batch(step, [g.samples for g in await buffer.take(2, version=0)])
        finally:
            await workers.stop()

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    held = {g.index: g for g in (*buffer.drain(), *workers.running.values(), *buffer.recycled_groups())}
    manager.record([g.samples for g in held.values()], "dropped", reason="run_completed")  # as fully_async does
    ledger.complete()  # raises if the workers held fewer groups than the ledger has in flight
    report = summarize(tmp_path / "run")
    assert report["trained"] == 6 and (report["lost"], report["duplicated"]) == (0, 0)
    closed = [e for e in report["epochs"] if e["closed"]]
    # launch pacing draws no more than the 3 steps train: the third epoch's prompts are all drawn,
    # but it closes only once the source moves past it, which it need not do here
    assert len(closed) >= 2 and [(e["trained"], e["filtered"]) for e in closed[:2]] == [(2, {"zero_std": 2})] * 2
    # the epochs drawn while the last batches trained: every prompt trained, filtered or dropped once
    assert all(e["trained"] + sum(e["filtered"].values()) + sum(e["dropped"].values()) == RECORDS for e in closed)
    assert set().union(*(e["dropped"] for e in closed[3:])) <= {"run_completed"}


def test_a_resume_draws_what_was_in_flight_at_the_checkpoint_again_once(fresh_kernels: None, tmp_path: Path) -> None:
    """fully_async's checkpoint comes while groups are in flight, past the data position it saves.
    The resumed run draws exactly those again (same ids) before new prompts; what the crashed
    attempt did after the checkpoint no longer counts; the epoch closes with 0 lost, 0 duplicated."""
    run = tmp_path / "run"
    run.mkdir()
    first = _manager(tmp_path)
    ledger = first.ledger
    assert ledger is not None
    ledger.begin(None, 0)
    groups = _generated(first, first.draw_groups(3))  # three prompts in flight ...
    first.record(groups, "in_flight")
    ledger.record_batch(1, groups[:1])  # ... one trained at step 1, then the checkpoint
    checkpoint = {"data": first.data.state_dict(), "rollout": first.state_dict(), "ledger": ledger.checkpoint_state()}
    assert [d["group"] for d in checkpoint["ledger"]["unsettled"]] == [1, 2]
    ledger.record_batch(2, groups[1:])  # the crashed attempt trained them too, then died
    ledger.close()

    resumed = _manager(tmp_path, ledger=Ledger(run, RECORDS))
    resumed.data.load_state_dict(checkpoint["data"])
    resumed.load_state_dict(checkpoint["rollout"])
    assert resumed.ledger is not None
    resumed.redraw(resumed.ledger.begin(checkpoint["ledger"], 1))
    again = _generated(resumed, resumed.draw_groups(3))
    assert [[s.index for s in g] for g in again[:2]] == [[s.index for s in g] for g in groups[1:]]  # same ids
    assert [g[0].prompt for g in again[:2]] == [g[0].prompt for g in groups[1:]]
    assert again[2][0].metadata["data_index"] not in {g[0].metadata["data_index"] for g in groups}
    resumed.ledger.record_batch(2, again[:2])
    resumed.ledger.record_batch(3, again[2:] + _generated(resumed, resumed.draw_groups(1)))  # epoch 0 closes
    report = summarize(run)
    assert report["resumes"] == 1 and report["epochs"][0]["closed"] and report["epochs"][0]["redrawn"] == 2
    assert (report["epochs"][0]["trained"], report["lost"], report["duplicated"]) == (4, 0, 0)


def test_a_prompt_in_flight_at_the_checkpoint_that_a_resume_skips_is_lost(fresh_kernels: None, tmp_path: Path) -> None:
    """What fully_async did before the ledger: a resume that does not draw the in-flight prompts
    again skips them (the data position is past them). Their epoch never closes, the completed
    run fails saying how many it lost, and ``miles ledger`` exits 1."""
    (tmp_path / "run").mkdir()
    first = _manager(tmp_path)
    ledger = first.ledger
    assert ledger is not None
    ledger.begin(None, 0)
    groups = first.draw_groups(2)
    ledger.record_batch(1, groups[:1])
    checkpoint = {"data": first.data.state_dict(), "rollout": first.state_dict(), "ledger": ledger.checkpoint_state()}
    ledger.close()

    resumed = _manager(tmp_path, ledger=Ledger(tmp_path / "run", RECORDS))
    resumed.data.load_state_dict(checkpoint["data"])
    resumed.load_state_dict(checkpoint["rollout"])
    assert resumed.ledger is not None
    resumed.ledger.begin(checkpoint["ledger"], 1)  # and forgets to redraw what it returns
    resumed.ledger.record_batch(2, resumed.draw_groups(3))
    assert summarize(tmp_path / "run")["in_flight"] == 1  # while it runs, it may still come back
    with pytest.raises(LedgerError, match="the run completed with 1 prompt group"):
        resumed.ledger.complete()
    report = summarize(tmp_path / "run")
    assert report["lost"] == 1 and not report["epochs"][0]["closed"]
    assert main(["ledger", str(tmp_path / "run")]) == 1


def test_a_prompt_trained_twice_is_duplicated_and_a_cut_short_last_line_is_ignored(
        fresh_kernels: None, tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    manager = _manager(tmp_path)
    ledger = manager.ledger
    assert ledger is not None
    ledger.begin(None, 0)
    [group] = manager.draw_groups(1)
    ledger.record_batch(1, [group])
    with pytest.raises(LedgerError, match="1 duplicated"):
        ledger.record_batch(2, [group] + manager.draw_groups(4))  # trained again; epoch 0 closes
    ledger.close()
    with (tmp_path / "run" / LEDGER_DIR / EVENTS_FILE).open("a") as f:
        f.write('{"seq": 99, "gro')  # the process was killed mid-line
    assert summarize(tmp_path / "run")["duplicated"] == 1
    assert main(["ledger", str(tmp_path / "run")]) == 1


def test_closed_epochs_are_compacted_at_checkpoints_so_the_events_file_stays_bounded(
        fresh_kernels: None, tmp_path: Path) -> None:
    """Twenty epochs: after each checkpoint the events file holds the open epoch only, each closed
    one is one summary line, and the report still covers every epoch; a resume after compaction
    reconciles as before."""
    run = tmp_path / "run"
    run.mkdir()
    manager = _manager(tmp_path)
    ledger = manager.ledger
    assert ledger is not None
    ledger.begin(None, 0)
    sizes = []
    for step in range(1, 41):  # two prompts a step, four a epoch
        ledger.record_batch(step, _generated(manager, manager.draw_groups(2)))
        ledger.compact(ledger.checkpoint_state())
        sizes.append(len((run / LEDGER_DIR / EVENTS_FILE).read_text().splitlines()))
    assert max(sizes[10:]) == max(sizes[:10])  # bounded: does not grow with the epochs
    assert len((run / LEDGER_DIR / EPOCHS_FILE).read_text().splitlines()) == 19  # epochs 0-18 (19 is open)
    report = summarize(run)
    assert [e["epoch"] for e in report["epochs"]] == list(range(20))
    assert all(e["trained"] == 4 for e in report["epochs"]) and (report["lost"], report["duplicated"]) == (0, 0)
    checkpoint = ledger.checkpoint_state()
    ledger.close()
    again = Ledger(run, RECORDS)
    assert again.begin(checkpoint, 40) == [] and summarize(run)["resumes"] == 1


def test_miles_ledger_explains_a_folder_without_a_ledger(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ledger", str(tmp_path)]) == 2
    assert "has no sample ledger" in capsys.readouterr().err


def test_a_damaged_ledger_is_refused_with_the_line_that_is_wrong(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A run folder may come from anyone: a line nested ten thousand deep, or one that is not a
    ledger line, is an error naming the file, not a traceback."""
    folder = tmp_path / LEDGER_DIR
    folder.mkdir()
    (folder / EVENTS_FILE).write_text("[" * 10000 + "\n" + '{"seq": 1, "event": "start", "upto": 0}\n')
    assert main(["ledger", str(tmp_path)]) == 2
    assert f"{folder / EVENTS_FILE}:1: not a JSON line" in capsys.readouterr().err
    (folder / EVENTS_FILE).write_text('{"seq": 1, "group": 0, "state": "drawn"}\n{"seq": 2, "event": "end"}\n')
    assert main(["ledger", str(tmp_path)]) == 2
    assert "is not a ledger line" in capsys.readouterr().err


def test_a_resume_whose_ledger_was_deleted_still_draws_what_was_in_flight(fresh_kernels: None, tmp_path: Path) -> None:
    """A run folder copied without ledger/: the resume does not refuse, draws the checkpoint's
    in-flight prompts again, and marks what came before as untracked."""
    (tmp_path / "run").mkdir()
    first = _manager(tmp_path)
    assert first.ledger is not None
    first.ledger.begin(None, 0)
    first.draw_groups(2)
    checkpoint = first.ledger.checkpoint_state()
    first.ledger.close()
    shutil.rmtree(tmp_path / "run" / LEDGER_DIR)
    again = Ledger(tmp_path / "run", RECORDS)
    assert [d.group for d in again.begin(checkpoint, 1)] == [0, 1]
    assert json.loads((tmp_path / "run" / LEDGER_DIR / EVENTS_FILE).read_text().splitlines()[0])["untracked"]


def _checkpoint_with_two_in_flight(tmp_path: Path) -> dict:
    """A run that drew three prompts, trained one and checkpointed: two are to be drawn again."""
    (tmp_path / "run").mkdir()
    first = _manager(tmp_path)
    assert first.ledger is not None
    first.ledger.begin(None, 0)
    groups = _generated(first, first.draw_groups(3))
    first.ledger.record_batch(1, groups[:1])
    checkpoint = {"data": first.data.state_dict(), "rollout": first.state_dict(), "ledger": first.ledger.checkpoint_state()}
    first.ledger.close()
    return checkpoint


def _resumed(tmp_path: Path, checkpoint: dict, **settings: object) -> RolloutManager:
    resumed = _manager(tmp_path, ledger=Ledger(tmp_path / "run", RECORDS), **settings)  # type: ignore[arg-type]
    resumed.data.load_state_dict(checkpoint["data"])
    resumed.load_state_dict(checkpoint["rollout"])
    assert resumed.ledger is not None
    resumed.redraw(resumed.ledger.begin(checkpoint["ledger"], 1))
    return resumed


def test_prompts_drawn_again_on_resume_pass_the_row_settings_check(fresh_kernels: None, tmp_path: Path) -> None:
    """The checkpoint's copy of a prompt in flight is checked like a data row: one whose settings
    this run refuses stops the resume naming it (data.on_error=fail), or is dropped with reason
    invalid_settings (skip); the other is drawn again as before, nothing lost."""
    checkpoint = _checkpoint_with_two_in_flight(tmp_path)
    bad = checkpoint["ledger"]["unsettled"][0]
    bad["prompt"]["metadata"]["settings"] = {"bogus": 1}
    with pytest.raises(DataError, match=rf"group {bad['group']} .*settings.bogus: not a setting"):
        _resumed(tmp_path, checkpoint, on_error="fail")
    shutil.rmtree(tmp_path / "run" / LEDGER_DIR)  # the refused resume wrote its start line; begin again
    (tmp_path / "run").rmdir()
    checkpoint = _checkpoint_with_two_in_flight(tmp_path)
    checkpoint["ledger"]["unsettled"][0]["prompt"]["metadata"]["settings"] = {"bogus": 1}
    resumed = _resumed(tmp_path, checkpoint)
    again = _generated(resumed, resumed.draw_groups(3))
    assert again[0][0].group_index == checkpoint["ledger"]["unsettled"][1]["group"]  # the valid one, first
    assert resumed.ledger is not None
    resumed.ledger.record_batch(2, again)
    epoch = summarize(tmp_path / "run")["epochs"][0]
    assert epoch["dropped"] == {"invalid_settings": 1} and (epoch["lost"], epoch["duplicated"]) == (0, 0)


def test_a_samples_per_prompt_override_on_resume_applies_to_redrawn_groups(fresh_kernels: None, tmp_path: Path) -> None:
    """Resumed with rollout.samples_per_prompt 3 (was 2): the redrawn groups have three samples,
    their first two ids kept and the third a fresh id; a checkpoint after lists the new ids;
    resumed with 1, a group keeps its first id."""
    checkpoint = _checkpoint_with_two_in_flight(tmp_path)
    before = [d["samples"] for d in checkpoint["ledger"]["unsettled"]]
    resumed = _resumed(tmp_path, checkpoint, samples_per_prompt=3)
    again = resumed.draw_groups(2)
    ids = [[s.index for s in g] for g in again]
    assert [i[:2] for i in ids] == before and all(len(i) == 3 for i in ids)
    fresh = [i[2] for i in ids]
    assert len(set(fresh)) == 2 and min(fresh) >= checkpoint["rollout"]["next_index"]
    assert resumed.ledger is not None
    assert [d["samples"] for d in resumed.ledger.checkpoint_state()["unsettled"]] == ids
    resumed.ledger.close()
    smaller = _resumed(tmp_path, checkpoint, samples_per_prompt=1)
    assert [[s.index for s in g] for g in smaller.draw_groups(2)] == [b[:1] for b in before]


def test_an_endless_source_keeps_its_events_file_bounded_and_a_lost_group_fails_the_next_checkpoint(
        fresh_kernels: None, tmp_path: Path) -> None:
    """``arithmetic`` never closes an epoch: each checkpoint folds the settled draws into running
    counts (open_epoch.json), so the events file does not grow with the run while the report
    still counts every prompt, also after a resume. A draw that nobody holds at a checkpoint is
    reported lost there, not at the end of the run."""
    run = tmp_path / "run"
    run.mkdir()
    manager = _manager(tmp_path, source="arithmetic", ledger=Ledger(run, None))
    ledger = manager.ledger
    assert ledger is not None
    ledger.begin(None, 0)
    sizes = []
    for step in range(1, 31):
        ledger.record_batch(step, _generated(manager, manager.draw_groups(2)))
        ledger.compact(ledger.checkpoint_state(held=set()))
        sizes.append((run / LEDGER_DIR / EVENTS_FILE).stat().st_size)
    assert max(sizes[10:]) <= max(sizes[:10])  # bounded: does not grow with the groups drawn
    report = summarize(run)
    assert (report["trained"], report["lost"], report["duplicated"], len(report["epochs"])) == (60, 0, 0, 1)
    checkpoint = ledger.checkpoint_state(held=set())
    positions = manager.data.state_dict(), manager.state_dict()
    ledger.close()
    again = Ledger(run, None)
    assert again.begin(checkpoint, 30) == [] and summarize(run)["trained"] == 60
    resumed = _manager(tmp_path, source="arithmetic", ledger=again)
    resumed.data.load_state_dict(positions[0])
    resumed.load_state_dict(positions[1])
    [held, dropped] = resumed.draw_groups(2)
    with pytest.raises(LedgerError, match=rf"1 prompt group\(s\) in flight .* held by no part of the loop .*"
                                          rf"\[{dropped[0].group_index}\]"):
        again.checkpoint_state(held={held[0].group_index})


def test_a_deterministic_round_redoes_a_group_a_dead_engine_spoiled_in_place(fresh_kernels: None, tmp_path: Path) -> None:
    """run.deterministic: a sample aborted by a dead engine makes its group generated again, same
    sample ids and sampling seeds, after the services are back (``recover``), instead of the
    over-sampler drawing another prompt: the step trains the groups a fault-free step trains."""
    (tmp_path / "run").mkdir()
    manager = _manager(tmp_path)
    manager.config.run.deterministic = True
    assert manager.ledger is not None
    manager.ledger.begin(None, 0)
    calls: list[tuple[int, int | None]] = []

    async def dies_once(sample: Sample, ctx: Any) -> Sample:
        calls.append((sample.index, ctx.sampling_params.sampling_seed))
        if sample.index == 1 and len(calls) <= 4:  # the first round: the engine died under sample 1
            return sample.finish(Status.ABORTED, ExitReason.ENGINE_ERROR, "connection refused")
        return await answer(sample, ctx)

    manager.generator = dies_once
    recovered: list[bool] = []

    async def recover() -> None:
        recovered.append(True)

    rollout = asyncio.run(manager.collect(1, recover=recover))
    assert recovered == [True] and rollout.metrics["rollout/groups_redone"] == 1.0
    assert [[s.index for s in g] for g in rollout.groups] == [[0, 1], [2, 3]]  # the groups drawn, none replaced
    assert all(s.status is Status.COMPLETED for g in rollout.groups for s in g)
    first = dict(calls[:4])
    assert sorted(calls[4:]) == sorted((i, first[i]) for i in (0, 1))  # the group again, with its seeds
    lines = [json.loads(line) for line in (tmp_path / "run" / LEDGER_DIR / EVENTS_FILE).read_text().splitlines()]
    assert [(line["group"], line["reason"]) for line in lines if line.get("state") == "recycled"] == [(0, "redo")]
