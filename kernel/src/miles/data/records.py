"""Reading records from JSONL files, parquet files and local Hugging Face ``datasets`` folders.

Every reader yields ``(location, fields)`` pairs, or ``(location, RecordProblem)`` for a record it
could not read; the location says where the record is: ``train.jsonl:17`` (lines count from 1, as
in an editor) or ``train.parquet row 16`` (rows count from 0, as in ``dataset[16]``). pyarrow and
datasets are imported only when a parquet file or a datasets folder is read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles import bounded_json
from miles.data.errors import DataError, RecordProblem, require_data_extra

RawRecord = tuple[str, "dict[str, Any] | RecordProblem"]
MAX_LISTED_PROBLEMS = 10


def files_of(path: Path, suffixes: tuple[str, ...], what: str) -> list[Path]:
    """``path`` itself, or the files with one of ``suffixes`` in the folder ``path`` (sorted)."""
    if not path.exists():
        raise DataError(f"data file or folder {str(path)!r} does not exist (data.path / data.eval_path)")
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(suffixes))
    if not files:
        raise DataError(f"folder {str(path)!r} holds no {what} files ({', '.join(suffixes)})")
    return files


def read_jsonl(path: Path) -> Iterator[RawRecord]:
    """One JSON object per line; blank lines are ignored. A line nested deeper than
    :data:`miles.bounded_json.MAX_DEPTH` levels is a malformed record (not a ``RecursionError``)."""
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            location = f"{path}:{number}"
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as exc:
                yield location, RecordProblem(f"not valid UTF-8 ({exc.reason} at byte {exc.start})")
                continue
            if not line:
                continue
            try:
                value = bounded_json.loads(line)
            except bounded_json.NestedTooDeep as exc:
                yield location, RecordProblem(f"refused: {exc}; a prompt record needs a few")
                continue
            except json.JSONDecodeError as exc:
                yield location, RecordProblem(f"not valid JSON ({exc.msg} at column {exc.colno})")
                continue
            if not isinstance(value, dict):
                yield location, RecordProblem(f"expected a JSON object, got {type(value).__name__}")
                continue
            yield location, value


def read_parquet(path: Path) -> Iterator[RawRecord]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        require_data_extra("pyarrow")
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 -- pyarrow raises several types for a bad file
        raise DataError(f"cannot read parquet file {str(path)!r}: {exc}") from None
    for index, row in enumerate(table.to_pylist()):
        yield f"{path} row {index}", row


def read_datasets_folder(path: Path, split: str) -> Iterator[RawRecord]:
    """A folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``, or a folder of
    data files that ``datasets.load_dataset(folder)`` understands (e.g. a downloaded hub dataset)."""
    try:
        import datasets
    except ImportError:
        require_data_extra("datasets")
    if not path.is_dir():
        raise DataError(f"data.path {str(path)!r} must be a folder for the hf_dataset source")
    saved = any((path / name).exists() for name in ("dataset_dict.json", "dataset_info.json", "state.json"))
    try:
        loaded = datasets.load_from_disk(str(path)) if saved else datasets.load_dataset(str(path))
    except Exception as exc:  # noqa: BLE001 -- datasets raises many types for unreadable folders
        raise DataError(f"cannot load the datasets folder {str(path)!r}: {type(exc).__name__}: {exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"datasets folder {str(path)!r} has no split {split!r}; it has {', '.join(loaded)} (data.options.split)")
        loaded = loaded[split]
    for index, row in enumerate(loaded):
        yield f"{path} [{split}] row {index}", row


@dataclass(slots=True)
class Problems:
    """Malformed records met while reading: counted, the first few kept for the message."""

    count: int = 0
    listed: list[str] = field(default_factory=list)

    def add(self, location: str, problem: RecordProblem) -> None:
        self.count += 1
        if len(self.listed) < MAX_LISTED_PROBLEMS:
            self.listed.append(f"{location}: {problem}")

    def summary(self) -> str:
        more = f"\n  ... and {self.count - len(self.listed)} more" if self.count > len(self.listed) else ""
        return "\n".join(f"  {line}" for line in self.listed) + more
