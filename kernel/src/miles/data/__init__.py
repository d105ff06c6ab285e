"""Data sources: prompts from files (JSONL, parquet, Hugging Face datasets folders) and task
generators (``arithmetic``), registered by name through ``miles_register_data_sources``.

The RL loop uses :func:`open_data_source`, :func:`eval_prompts` and :func:`source_metrics`;
``docs/design/data.md`` explains the choices.
"""

from miles.data.errors import DataError
from miles.data.source import HasEvalSplit, ReportsMetrics, eval_prompts, open_data_source, source_metrics

__all__ = ["DataError", "HasEvalSplit", "ReportsMetrics", "eval_prompts", "open_data_source", "source_metrics"]
