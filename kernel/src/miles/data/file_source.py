"""``FileSource``: prompts from files, in a seeded order that is reshuffled every epoch.

All records are read and validated when the source opens, so a malformed record is reported
before the first step: with ``data.on_error: fail`` the first one raises (file and line in the
message); with ``skip`` every one is skipped, counted (``data/skipped_records``) and the first few
are logged with their file and line. A row whose ``settings`` fail validation against the run's
plugins (:mod:`miles.data.row_settings`) is malformed the same way, its field named, and also
counted in ``data/rows_invalid``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_contracts import Sample
from pydantic import BaseModel, ConfigDict, ValidationError

from miles.data.errors import DataError, RecordProblem
from miles.data.order import EpochOrder
from miles.data.prompts import PromptRecord, PromptSpec
from miles.data.records import Problems, RawRecord, files_of, read_datasets_folder, read_jsonl, read_parquet
from miles.data.row_settings import RowSettings, SettingsProblem

if TYPE_CHECKING:
    from miles_contracts import RunContext

    from miles.sections import DataSection

logger = logging.getLogger(__name__)


class FileSource:
    """A :class:`miles_contracts.DataSource` over validated records (also ``len()`` and ``metrics()``)."""

    def __init__(self, records: list[PromptRecord], *, seed: int, shuffle: bool, skipped: int = 0, invalid: int = 0,
                 name: str = "") -> None:
        self.records = records
        self.order = EpochOrder(len(records), seed=seed, shuffle=shuffle)
        self.skipped = skipped
        self.invalid = invalid
        self.name = name

    @classmethod
    def read(cls, config: DataSection, raw_records: Iterable[RawRecord], *, name: str,
             settings: RowSettings | None = None) -> FileSource:
        """Validate every record with the config's prompt settings (and its ``settings`` with
        ``settings``, the run's check) and apply ``data.on_error``."""
        spec = PromptSpec.from_config(config)
        records: list[PromptRecord] = []
        problems = Problems()
        invalid = 0
        for location, fields in raw_records:
            try:
                if isinstance(fields, RecordProblem):
                    raise fields
                record = spec.build(fields)
                checked = settings.check(fields, record.metadata) if settings is not None else None
            except RecordProblem as problem:
                if config.on_error == "fail":
                    raise DataError(
                        f"{location}: {problem}. Fix or remove this record, or set data.on_error=skip to skip malformed records"
                    ) from None
                problems.add(location, problem)
                invalid += isinstance(problem, SettingsProblem)
                continue
            metadata = {**record.metadata, "data_location": location, **({"settings": checked} if checked else {})}
            records.append(PromptRecord(record.prompt, record.label, metadata))
        if problems.count:
            logger.warning("data source %s: skipped %d malformed record(s) (data.on_error=skip):\n%s", name, problems.count, problems.summary())
        if not records:
            detail = f"; all {problems.count} records were malformed:\n{problems.summary()}" if problems.count else ""
            raise DataError(f"data source {name} found no prompts in {config.path}{detail}")
        return cls(records, seed=config.seed, shuffle=config.shuffle, skipped=problems.count, invalid=invalid, name=name)

    def __len__(self) -> int:
        return len(self.records)

    def next_prompts(self, n: int) -> list[Sample]:
        return [self.records[index].to_sample(data_epoch=epoch, data_index=index) for index, epoch in self.order.take(n)]

    def state_dict(self) -> dict[str, Any]:
        return {"order": self.order.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.order.load_state_dict(state["order"])

    def metrics(self) -> dict[str, float]:
        return {"data/epoch": float(self.order.epoch), "data/skipped_records": float(self.skipped),
                "data/rows_invalid": float(self.invalid)}


# ------------------------------------------------------------------ registered factories


class _NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DatasetsOptions(_NoOptions):
    split: str = "train"


def parse_options(model: type[BaseModel], config: DataSection) -> Any:
    try:
        return model.model_validate(config.options)
    except ValidationError as exc:
        problems = "; ".join(
            f"data.options.{'.'.join(map(str, e['loc']))}: "
            + ("not an option of this data source" if e["type"] == "extra_forbidden" else e["msg"])
            for e in exc.errors()
        )
        known = ", ".join(model.model_fields) or "none"
        raise DataError(f"data source {config.source!r}: {problems} (its options: {known})") from None


def _path_of(config: DataSection) -> Path:
    if not config.path:
        raise DataError(f"data source {config.source!r} reads files: set data.path to a file or folder")
    return Path(config.path).expanduser()


def _files_source(reader: Callable[[Path], Iterable[RawRecord]], suffixes: tuple[str, ...],
                  what: str) -> Callable[[RunContext, DataSection], FileSource]:
    def factory(ctx: RunContext, config: DataSection) -> FileSource:
        parse_options(_NoOptions, config)
        files = files_of(_path_of(config), suffixes, what)
        return FileSource.read(config, (record for file in files for record in reader(file)), name=config.source,
                               settings=RowSettings(ctx))

    factory.__doc__ = f"Prompts from {what} files (data.path: a file or a folder of them)."
    return factory


jsonl_source = _files_source(read_jsonl, (".jsonl",), "JSONL")
parquet_source = _files_source(read_parquet, (".parquet",), "parquet")


def datasets_source(ctx: RunContext, config: DataSection) -> FileSource:
    """Prompts from a local Hugging Face datasets folder (data.options.split, default train)."""
    options = parse_options(DatasetsOptions, config)
    return FileSource.read(config, read_datasets_folder(_path_of(config), options.split), name=config.source,
                           settings=RowSettings(ctx))
