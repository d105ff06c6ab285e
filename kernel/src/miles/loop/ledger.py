"""The sample ledger: what became of every prompt the loop drew, in the run folder.

::

    ledger/events.jsonl   one line per change of state of a prompt group, append-only between checkpoints
    ledger/epochs.jsonl   one summary line per closed epoch (its events leave events.jsonl at a checkpoint)

A **draw** is one prompt the loop handed the generator: its prompt group (``group``: the group
index, stable across recycling and resume) and its episodes (``samples``: their indices), the data
``epoch`` and the record's ``data_index`` within it. A draw goes through ``drawn``, ``in_flight``,
``generated`` and may be ``aborted`` or ``recycled`` (generated again, same ids); it ends exactly
once as ``trained`` (at a step), ``filtered`` (a filter's reason) or ``dropped`` (a reason).

**Checkpoints.** Every line has a sequence number; a checkpoint stores the last one written (and
the draws not yet settled then). A resume appends ``{"event": "start", "upto": seq}``: lines after
``seq`` belong to the attempt that crashed and no longer count (their steps run again, from the
checkpoint's weights), and the draws unsettled at the checkpoint are drawn again, with their ids,
before any new prompt (:meth:`Ledger.begin`). So what was trained is never trained again and what
was in flight is drawn again exactly once.

**The invariant** (:meth:`Book.close`): an epoch closes once the data source has moved past it and
every draw of it is settled; then each of its prompts (``data_index`` 0..size-1, when the source
knows its size) has exactly one final state. ``lost`` counts prompts with none, ``duplicated``
those with more; the loop checks every epoch as it closes and fails the run if either is not 0.

**Size.** A closed epoch whose lines all precede a complete checkpoint (no resume can reach back
into it) is compacted after that checkpoint: its summary is appended to ``epochs.jsonl``, then
``events.jsonl`` is rewritten without its lines (and without the lines a resume voided). The
events file holds the open epochs only; the summaries grow by one line per epoch. An endless
source's epoch never closes: at each checkpoint its settled draws are folded into running counts
(``ledger/open_epoch.json``, :meth:`Ledger._fold`) and leave the events file, and a draw the loop
no longer holds is reported lost at that checkpoint (:meth:`Ledger.checkpoint_state`).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_contracts import Sample

from miles import bounded_json
from miles.loop.episodes import training_rows
from miles.loop.ledger_summary import OPEN_FILE, EpochSummary, LedgerError, read_folds, write_folds

LEDGER_DIR = "ledger"
EVENTS_FILE = "events.jsonl"
EPOCHS_FILE = "epochs.jsonl"

STATES = ("drawn", "in_flight", "generated", "aborted", "recycled", "filtered", "trained", "dropped")
FINAL = frozenset({"trained", "filtered", "dropped"})


@dataclass(slots=True)
class Draw:
    """One drawn prompt and where it stands."""

    group: int
    samples: list[int]
    epoch: int
    data_index: int | None
    state: str = "drawn"
    reason: str | None = None
    step: int | None = None
    finals: int = 0
    redrawn: int = 0  # drawn again after a resume (it was in flight at the checkpoint)
    prompt: dict[str, Any] | None = None  # the writer's copy of the prompt as drawn (to draw it again)

    @property
    def settled(self) -> bool:
        return self.finals > 0

    @property
    def key(self) -> int:
        """The prompt within its epoch: its data index, or (a source that gives none) its group."""
        return self.data_index if self.data_index is not None else -1 - self.group


class Book:
    """The ledger's state, rebuilt from its lines (the loop's writer and ``miles ledger`` share it)."""

    def __init__(self) -> None:
        self.live: list[dict[str, Any]] = []  # the lines of open epochs that count (a resume voids later ones)
        self.draws: dict[int, Draw] = {}
        self.closed: dict[int, EpochSummary] = {}
        self.epoch_size: int | None = None
        self.last_seq = 0
        self.resumes = 0
        self.ended: str | None = None  # the status of a run that ended (None: running, or killed)
        self.checked: set[int] = set()  # epochs the loop closed and checked
        self.first_full_epoch: int | None = 0  # epochs before it were partly drawn before the ledger existed
        # an endless source's epoch never closes: the draws settled before a checkpoint are folded
        # into these running counts (ledger/open_epoch.json) and leave the events file
        self.folded: dict[int, EpochSummary] = {}
        self.last_folded: set[int] = set()  # groups the latest fold took (their lines may still be on disk)

    # ------------------------------------------------------------------ reading lines

    def apply(self, line: dict[str, Any], *, replay: bool = False) -> None:
        """Apply one line (an event of a draw, or a ``start`` / ``end`` marker); ``replay``: again,
        after a rollback (a marker's own rollback and count were applied the first time)."""
        self.last_seq = max(self.last_seq, int(line["seq"]))
        marker = line.get("event")
        if marker == "start":
            self.epoch_size = line.get("epoch_size")
            self.ended = None
            if not replay:
                self.resumes += bool(line.get("resumed"))
                self._rollback(int(line["upto"]))
            if line.get("untracked"):  # resumed from a checkpoint older than the ledger
                self.first_full_epoch = None
        elif marker == "end":
            self.ended = str(line["status"])
        else:
            self._event(line)
        self.live.append(line)

    def _event(self, line: Mapping[str, Any]) -> None:
        group, state = int(line["group"]), str(line["state"])
        if state not in STATES:
            raise LedgerError(f"ledger line {line['seq']}: unknown state {state!r} (one of {', '.join(STATES)})")
        draw = self.draws.get(group)
        if state == "drawn":
            if draw is not None and draw.settled:
                draw.finals += 1  # a settled prompt handed out again: it will be counted twice
                return
            if draw is not None:
                draw.redrawn += 1
                draw.samples = list(line["samples"])  # a resume may have resized the group
            else:
                self.draws[group] = Draw(group, list(line["samples"]), int(line["epoch"]), line.get("data_index"))
                if self.first_full_epoch is None:  # the epoch a resume without a ledger landed in was partly untracked
                    self.first_full_epoch = int(line["epoch"]) + 1
            return
        if draw is None:
            raise LedgerError(f"ledger line {line['seq']}: group {group} was never drawn but became {state!r}")
        draw.state, draw.reason, draw.step = state, line.get("reason"), line.get("step")
        if state in FINAL:
            draw.finals += 1

    def _rollback(self, upto: int) -> None:
        """Forget the lines after ``upto`` (the checkpoint a run resumed from); replays the rest."""
        kept = [line for line in self.live if int(line["seq"]) <= upto]
        if len(kept) == len(self.live):
            return
        self.live, self.draws, self.first_full_epoch = [], {}, 0
        for line in kept:
            self.apply(line, replay=True)

    # ------------------------------------------------------------------ epochs

    def epochs(self) -> list[int]:
        return sorted({d.epoch for d in self.draws.values()} | set(self.closed) | set(self.folded))

    def summary(self, epoch: int) -> EpochSummary:
        """Epoch ``epoch`` as it stands (the stored summary once it was compacted)."""
        if epoch in self.closed:
            return self.closed[epoch]
        draws = [d for d in self.draws.values() if d.epoch == epoch]
        out = EpochSummary(epoch, self.epoch_size, drawn=len(draws))
        if epoch in self.folded:
            out.add(self.folded[epoch])
        finals: Counter[int] = Counter()
        for draw in draws:
            finals[draw.key] += draw.finals
            out.redrawn += draw.redrawn
            if not draw.settled:
                out.in_flight += 1
        for line in self.live:  # recycled and aborted are passing states: count every time
            passing = self.draws.get(int(line["group"])) if line.get("state") in ("recycled", "aborted") else None
            if passing is not None and passing.epoch == epoch:
                (out.recycled if line["state"] == "recycled" else out.aborted)[line.get("reason") or "unknown"] += 1
        for draw in draws:
            if draw.state == "trained":
                out.trained += 1
            elif draw.state in ("filtered", "dropped"):
                (out.filtered if draw.state == "filtered" else out.dropped)[draw.reason or "unknown"] += 1
        out.duplicated = sum(n - 1 for n in finals.values() if n > 1)
        out.closed = self.closable(epoch)
        if out.closed or self.ended == "completed":  # an epoch a completed run left open: nothing comes back
            size, full_from = self.epoch_size, self.first_full_epoch
            never_drawn = size - len(finals) if out.closed and size and full_from is not None and epoch >= full_from else 0
            out.lost = out.in_flight + never_drawn
        return out

    def closable(self, epoch: int) -> bool:
        """The source has moved past ``epoch`` and every draw of it is settled."""
        later = any(d.epoch > epoch for d in self.draws.values()) or any(e > epoch for e in self.closed)
        return later and all(d.settled for d in self.draws.values() if d.epoch == epoch)

    def unchecked_epochs(self) -> list[int]:
        return [e for e in self.epochs() if e not in self.closed and e not in self.checked]

    def check(self, epoch: int) -> EpochSummary:
        """Check closed ``epoch``: its summary; raises if it broke the invariant."""
        summary = self.summary(epoch)
        self.checked.add(epoch)
        if summary.lost or summary.duplicated:
            raise LedgerError(
                f"sample ledger: epoch {epoch} closed with {summary.lost} prompt(s) lost (never trained nor dropped "
                f"with a reason) and {summary.duplicated} duplicated (settled more than once) of {summary.prompts} "
                f"drawn {summary.drawn} times; a bug in the loop: report it with the run folder's ledger/ "
                f"(`miles ledger RUN_DIR` prints the summary)")
        return summary

    def unsettled(self) -> list[Draw]:
        return [d for d in self.draws.values() if not d.settled]


def read_book(folder: Path) -> Book:
    """The ledger in ``folder`` (``<run>/ledger``) as it stands on disk."""
    book = Book()
    epochs_path, events_path = folder / EPOCHS_FILE, folder / EVENTS_FILE
    summarised: set[int] = set()  # groups of epochs already in epochs.jsonl
    book.folded, book.last_folded = read_folds(folder / OPEN_FILE)
    for path, line in [*_records(epochs_path), *_records(events_path)]:
        try:
            if path == epochs_path:
                summary = EpochSummary.from_json(line)
                book.closed[summary.epoch] = summary
                continue
            # a compaction that stopped between its two writes left lines of an epoch already summarised
            if line.get("state") == "drawn" and int(line["epoch"]) in book.closed:
                summarised.add(int(line["group"]))
            if "event" not in line and (int(line["group"]) in summarised or int(line["group"]) in book.last_folded):
                continue
            book.apply(line)
        except (KeyError, TypeError, ValueError) as exc:  # a field missing or of the wrong kind
            raise LedgerError(f"{path}: {str(line)[:200]} is not a ledger line ({exc!r}); the ledger was edited "
                              f"or damaged") from None
    return book


def _records(path: Path) -> list[tuple[Path, dict[str, Any]]]:
    return [(path, line) for line in _lines(path)] if path.is_file() else []


def _lines(path: Path) -> Iterable[dict[str, Any]]:
    """A JSONL file's records; a last line cut short by a kill is left out. The folder may come
    from anyone (``miles ledger``, ``--resume``): JSON only, nesting bounded, objects only."""
    lines = path.read_text().split("\n")
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = bounded_json.loads(raw)
        except ValueError:
            if number == len(lines):  # the process died while writing it
                return
            raise LedgerError(f"{path}:{number}: not a JSON line; the ledger was edited or damaged") from None
        if not isinstance(record, dict):
            raise LedgerError(f"{path}:{number}: a ledger line is a JSON object, got {type(record).__name__}")
        yield record


class Ledger:
    """The loop's writer: :meth:`record` a state change, :meth:`checkpoint_state` with every
    checkpoint, :meth:`compact` once it is complete, :meth:`check` after every step.

    :param run_dir: the run folder.
    :param epoch_size: prompts per epoch (the source's ``len()``), None when it has no end.
    """

    def __init__(self, run_dir: Path, epoch_size: int | None) -> None:
        self.folder = run_dir / LEDGER_DIR
        self.folder.mkdir(exist_ok=True)
        self.book = read_book(self.folder)
        self.epoch_size = epoch_size
        self.seq = self.book.last_seq
        self._file = (self.folder / EVENTS_FILE).open("a", buffering=1)  # a line reaches the OS at once
        if self._file.tell() and not (self.folder / EVENTS_FILE).read_text().endswith("\n"):
            self._file.write("\n")  # the crashed run's last line was cut short

    # ------------------------------------------------------------------ the loop's calls

    def begin(self, checkpoint: Mapping[str, Any] | None, step: int) -> list[Draw]:
        """Start (or resume at ``checkpoint``, the ledger part of a checkpoint, at ``step``): lines after
        the checkpoint no longer count. Returns the draws to draw again before any new prompt.
        A checkpoint from before the ledger: ``{"seq": 0, "unsettled": [], "untracked": True}``."""
        upto = int(checkpoint["seq"]) if checkpoint is not None else 0
        # no ledger on disk (deleted, or a folder copied without it): what came before is not tracked
        gone = checkpoint is not None and not self.book.live and not self.book.closed
        self._write({"event": "start", "upto": upto, "step": step, "epoch_size": self.epoch_size,
                     "resumed": checkpoint is not None,
                     "untracked": gone or bool((checkpoint or {}).get("untracked"))})
        redraw = [Draw(int(d["group"]), list(d["samples"]), int(d["epoch"]), d.get("data_index"), prompt=d["prompt"])
                  for d in (checkpoint or {}).get("unsettled", [])]
        missing = {d.group for d in self.book.unsettled()} ^ {d.group for d in redraw}
        if missing and not gone:
            raise LedgerError(f"the checkpoint and the ledger disagree on which prompts were in flight (groups "
                              f"{sorted(missing)[:10]}): ledger/ does not belong to this checkpoint")
        for draw in redraw:  # a checkpoint before they are drawn again must still hold their prompts
            if draw.group in self.book.draws:
                self.book.draws[draw.group].prompt = draw.prompt
        return redraw

    def record(self, samples: Sequence[Sample], state: str, *, reason: str | None = None,
               step: int | None = None) -> None:
        """Record that the prompt group ``samples`` (its episodes, as the loop holds them) is now
        ``state`` (one of :data:`STATES`), with ``reason`` (why it was filtered, recycled, aborted or
        dropped) or ``step`` (the step that trained it)."""
        if not samples:
            return
        first = samples[0]
        line: dict[str, Any] = {"group": first.group_index, "state": state}
        if state == "drawn":
            line.update(samples=[s.index for s in samples], epoch=_epoch_of(first), data_index=_data_index_of(first))
        if reason is not None:
            line["reason"] = reason
        if step is not None:
            line["step"] = step
        self._write(line)
        if state == "drawn":
            draw = self.book.draws[first.group_index]
            if draw.prompt is None:
                draw.prompt = {"prompt": first.prompt, "label": first.label, "metadata": first.metadata}

    def checkpoint_state(self, held: Collection[int] | None = None) -> dict[str, Any]:
        """The ledger's part of a checkpoint: where it stands and the draws in flight (to draw again
        on resume). Every line it counts is on disk when it returns.

        ``held``: the groups the loop holds now (generating, scoring, queued, waiting to be
        recycled or redrawn). A draw unsettled and held by nobody is lost, and an endless source
        would otherwise show it only when the run completes: it raises :class:`LedgerError` here,
        at the checkpoint after it was lost."""
        self._file.flush()
        os.fsync(self._file.fileno())
        if held is not None:
            lost = sorted(d.group for d in self.book.unsettled() if d.group not in held)
            if lost:
                raise LedgerError(f"sample ledger: {len(lost)} prompt group(s) in flight by the ledger are held by no "
                                  f"part of the loop at a checkpoint ({lost[:10]}): lost; a "
                                  f"bug in the loop (`miles ledger RUN_DIR` prints the summary)")
        return {"seq": self.seq, "unsettled": [
            {"group": d.group, "samples": d.samples, "epoch": d.epoch, "data_index": d.data_index, "prompt": d.prompt}
            for d in self.book.unsettled()]}

    def record_batch(self, step: int, groups: Sequence[Sequence[Sample]]) -> list[EpochSummary]:
        """Step ``step`` trains ``groups`` (one without a trainable row is dropped, ``untrainable``);
        then :meth:`check`. The epochs that closed."""
        for group in groups:
            if training_rows([group]):
                self.record(group, "trained", step=step)
            else:
                self.record(group, "dropped", reason="untrainable")
        return self.check()

    def check(self) -> list[EpochSummary]:
        """Close every epoch that can be (raises :class:`LedgerError` if one broke the invariant)."""
        return [self.book.check(e) for e in self.book.unchecked_epochs() if self.book.closable(e)]

    def complete(self) -> None:
        """The run completed: every draw must be settled (raises otherwise)."""
        self._write({"event": "end", "status": "completed"})
        self._file.flush()
        if self.book.unsettled():
            groups = sorted(d.group for d in self.book.unsettled())
            raise LedgerError(f"sample ledger: the run completed with {len(groups)} prompt group(s) neither trained "
                              f"nor dropped with a reason ({groups[:10]}); a bug in the loop")

    def compact(self, checkpoint: Mapping[str, Any]) -> None:
        """After ``checkpoint`` (its ledger part) is complete: summaries of the closed epochs it
        covers go to epochs.jsonl, and events.jsonl keeps only the lines still needed."""
        upto = int(checkpoint["seq"])
        done = {e for e in self.book.checked - set(self.book.closed) if self._last_seq_of(e) <= upto}
        folded = self._fold(upto) if self.epoch_size is None else set()
        if not done and not folded and len(self.book.live) == self._lines_on_disk:
            return
        if done:
            with (self.folder / EPOCHS_FILE).open("a") as epochs:
                for epoch in sorted(done):
                    self.book.closed[epoch] = self.book.summary(epoch)
                    epochs.write(json.dumps(self.book.closed[epoch].to_json()) + "\n")
                epochs.flush()
                os.fsync(epochs.fileno())
        keep = [line for line in self.book.live if not self._in_epochs(line, done)
                and not ("event" not in line and int(line["group"]) in folded)]
        tmp = self.folder / (EVENTS_FILE + ".tmp")
        with tmp.open("w") as out:
            out.writelines(json.dumps(line) + "\n" for line in keep)
            out.flush()
            os.fsync(out.fileno())
        self._file.close()
        tmp.replace(self.folder / EVENTS_FILE)
        self._file = (self.folder / EVENTS_FILE).open("a", buffering=1)
        self.book.live = keep
        for group in [g for g, d in self.book.draws.items() if d.epoch in done]:
            del self.book.draws[group]
        self._lines_on_disk = len(keep)

    def _fold(self, upto: int) -> set[int]:
        """An endless source's open epoch: fold the draws settled with every line at or before
        ``upto`` (a complete checkpoint: no resume reaches back past it) into running counts,
        written to open_epoch.json before the events file loses their lines. Their groups."""
        last_seq: dict[int, int] = {}
        for line in self.book.live:
            if "event" not in line:
                last_seq[int(line["group"])] = int(line["seq"])
        fold = {g for g, d in self.book.draws.items() if d.settled and last_seq.get(g, 0) <= upto}
        if not fold:
            return set()
        book = self.book
        for epoch in {book.draws[g].epoch for g in fold}:
            counted = Book()  # the folded draws of this epoch, counted the way summary() counts
            counted.live = [line for line in book.live if "event" not in line and int(line["group"]) in fold
                            and book.draws[int(line["group"])].epoch == epoch]
            counted.draws = {g: book.draws[g] for g in fold if book.draws[g].epoch == epoch}
            part = counted.summary(epoch)
            book.folded.setdefault(epoch, EpochSummary(epoch, None)).add(part)
        for group in fold:
            del book.draws[group]
        book.last_folded = fold
        write_folds(self.folder / OPEN_FILE, book.folded, fold)
        return fold

    def close(self) -> None:
        self._file.close()

    # ------------------------------------------------------------------ internals

    _lines_on_disk = -1  # lines of events.jsonl since the last compaction (-1: not compacted yet)

    def _write(self, line: dict[str, Any]) -> None:
        self.seq += 1
        line = {"seq": self.seq, **line}
        self.book.apply(line)  # first: a line the book refuses is a loop bug, and never reaches the file
        self._file.write(json.dumps(line) + "\n")

    def _epoch_of_line(self, line: Mapping[str, Any]) -> int | None:
        if "epoch" in line:
            return int(line["epoch"])
        draw = self.book.draws.get(int(line["group"])) if "group" in line else None
        return draw.epoch if draw is not None else None

    def _in_epochs(self, line: Mapping[str, Any], epochs: set[int]) -> bool:
        return "event" not in line and self._epoch_of_line(line) in epochs

    def _last_seq_of(self, epoch: int) -> int:
        return max((int(line["seq"]) for line in self.book.live if "event" not in line
                    and self._epoch_of_line(line) == epoch), default=0)


def _epoch_of(sample: Sample) -> int:
    epoch = sample.metadata.get("data_epoch", 0)
    return int(epoch) if isinstance(epoch, int) else 0


def _data_index_of(sample: Sample) -> int | None:
    index = sample.metadata.get("data_index")
    return int(index) if isinstance(index, int) else None


def regroup(draw: Draw) -> list[Sample]:
    """The prompt group of ``draw`` as it was drawn, with its ids (to draw it again after a resume)."""
    prompt = draw.prompt or {}
    return [Sample(prompt=prompt.get("prompt", ""), label=prompt.get("label"), metadata=dict(prompt.get("metadata", {})),
                   group_index=draw.group, index=index) for index in draw.samples]


def summarize(run_dir: Path) -> dict[str, Any]:
    """``miles ledger``'s report of ``run_dir``: per epoch and in total."""
    folder = run_dir / LEDGER_DIR
    if not (folder / EVENTS_FILE).is_file() and not (folder / EPOCHS_FILE).is_file():
        raise LedgerError(f"{run_dir} has no sample ledger ({folder}/{EVENTS_FILE}): not a run folder, or a run "
                          f"from before the ledger")
    book = read_book(folder)
    epochs = [book.summary(e).to_json() for e in book.epochs()]
    return {"run_dir": str(run_dir), "status": book.ended or "running or stopped", "resumes": book.resumes,
            "epochs": epochs, "lost": sum(e["lost"] for e in epochs),
            "duplicated": sum(e["duplicated"] for e in epochs),
            "trained": sum(e["trained"] for e in epochs), "in_flight": sum(e["in_flight"] for e in epochs)}


__all__ = ["FINAL", "STATES", "Book", "Draw", "EpochSummary", "Ledger", "LedgerError", "read_book", "regroup",
           "summarize"]
