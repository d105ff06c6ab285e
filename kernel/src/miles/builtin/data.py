"""Built-in plugin ``data``: file sources (``jsonl``, ``parquet``, ``hf_dataset``) and the
``arithmetic`` task generator."""

from __future__ import annotations

from miles.data.arithmetic import ArithmeticTask
from miles.data.file_source import datasets_source, jsonl_source, parquet_source
from miles.hookspecs import hookimpl
from miles.registry import Register


@hookimpl
def miles_register_data_sources(register: Register) -> None:
    register("jsonl", jsonl_source)
    register("parquet", parquet_source)
    register("hf_dataset", datasets_source)
    register("arithmetic", ArithmeticTask.from_config)
