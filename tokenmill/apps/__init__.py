"""Applications over the client and the engine: `annotate` (one template over a JSONL/CSV/Parquet dataset) and
`batch` (OpenAI Batch API files), embedded or across the queue, resumable from a checkpoint, with their CLI
parsers (`cli`). Needs the `annotate` extra (pyarrow, jinja2, rich); the embedded mode also the `worker` extra
(torch)."""
