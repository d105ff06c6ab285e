"""Built-in plugin ``data``: file sources (``jsonl``, ``parquet``, ``hf_dataset``) and the
``arithmetic`` task generator."""

from __future__ import annotations

from miles_contracts import DataSourceSpec

from miles.data.arithmetic import ArithmeticTask
from miles.data.file_source import datasets_source, jsonl_source, parquet_source
from miles.hookspecs import hookimpl
from miles.registry import Register


@hookimpl
def miles_register_data_sources(register: Register[DataSourceSpec]) -> None:
    register("jsonl", DataSourceSpec(jsonl_source))
    register("parquet", DataSourceSpec(parquet_source))
    register("hf_dataset", DataSourceSpec(datasets_source))
    register("arithmetic", DataSourceSpec(ArithmeticTask.open))
