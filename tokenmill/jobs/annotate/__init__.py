"""Bulk dataset work: `annotate` (one template over a JSONL/CSV/Parquet dataset) and `batch` (OpenAI Batch
API files), embedded or across the queue, resumable from a checkpoint. Needs the `annotate` extra (pyarrow,
jinja2, rich); the embedded mode also the `worker` extra (torch)."""

from tokenmill.jobs.annotate.annotate import annotate
from tokenmill.jobs.annotate.io import DatasetError
from tokenmill.jobs.annotate.pipeline import Summary

__all__ = ["DatasetError", "Summary", "annotate"]
