"""Datasets in and out: JSONL, CSV or Parquet, local or `s3://`, read and written in record batches.

Everything here goes through pyarrow (its dataset scanner and its S3 filesystem), so there is no
hand-written CSV, JSON-lines or multipart-upload code. A dataset is read twice by the pipeline (once to
compute, once to write the output from the checkpoint), each time as a stream of record batches, so
memory stays bounded whatever the input size.
"""

from __future__ import annotations

import fnmatch
import glob
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.json as pajson
import pyarrow.parquet as pq

FORMATS = {".jsonl": "json", ".ndjson": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
#: Rows per record batch handed to the pipeline (Parquet; JSON/CSV batches follow their block size).
BATCH_ROWS = 4096
_BLOCK_BYTES = 1 << 20  # CSV/JSON read block
_ENDPOINT_ENV = ("TOKENMILL_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


class DatasetError(ValueError):
    """The input or output cannot be used at all (unreadable, unknown format): the run cannot start."""


def s3_endpoint(explicit: str | None = None) -> str | None:
    """The S3 endpoint for MinIO and other S3-compatible stores: the flag, else the environment."""
    return explicit or next((os.environ[name] for name in _ENDPOINT_ENV if os.environ.get(name)), None)


def filesystem(uri: str, endpoint: str | None = None) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem for `uri` and the path inside it."""
    if uri.startswith("s3://"):
        options: dict[str, Any] = {}
        endpoint = s3_endpoint(endpoint)
        if endpoint:
            options["endpoint_override"] = endpoint
        options["allow_delayed_open"] = True  # small objects go up in one PutObject, not a multipart upload
        options["region"] = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1"
        return pafs.S3FileSystem(**options), uri.removeprefix("s3://")
    return pafs.LocalFileSystem(), os.path.abspath(uri)


def format_of(path: str, explicit: str | None, what: str) -> str:
    """`json`, `csv` or `parquet`: `explicit` if given, else from the extension."""
    if explicit:
        name = {"jsonl": "json"}.get(explicit.lower(), explicit.lower())
        if name not in ("json", "csv", "parquet"):
            raise DatasetError(f"{what} format: must be jsonl, csv or parquet, got {explicit!r}")
        return name
    extension = os.path.splitext(path.rstrip("/"))[1].lower()
    if extension not in FORMATS:
        raise DatasetError(
            f"{what} {path!r}: cannot tell the format from the extension {extension or '(none)'!r} "
            f"(known: {', '.join(sorted(FORMATS))}); name the format with --{what}-format"
        )
    return FORMATS[extension]


@dataclass
class Dataset:
    """An input dataset: its shard files in order and their format."""

    uri: str
    files: list[str]
    format: str
    fs: pafs.FileSystem

    def _dataset(self) -> ds.Dataset:
        return self._dataset_of(self.files)

    def _dataset_of(self, files: list[str]) -> ds.Dataset:
        fmt: Any = self.format
        if fmt == "parquet":  # pre-buffering reads a whole file's column chunks at once: memory would grow with it
            fmt = ds.ParquetFileFormat(default_fragment_scan_options=ds.ParquetFragmentScanOptions(pre_buffer=False))
        elif fmt == "json":  # the schema comes from the first block only
            fmt = ds.JsonFileFormat(read_options=pajson.ReadOptions(block_size=_BLOCK_BYTES))
        return ds.dataset(files, format=fmt, filesystem=self.fs)

    @property
    def schema(self) -> pa.Schema:
        return self._guard(lambda: self._dataset().schema)

    def count_rows(self) -> int:
        """Parquet: from the footers. CSV/JSONL: one streaming pass (which also finds a corrupt file before any
        work starts)."""
        if self.format == "parquet":
            return self._guard(lambda: self._dataset().count_rows())
        return sum(batch.num_rows for batch in self.batches())

    def batches(self) -> Iterator[pa.RecordBatch]:
        """The rows in file order, then row order, as record batches of bounded size."""
        schema = self.schema
        for path in self.files:
            reader = self._guard(lambda: self._reader(path, schema))
            while True:
                batch = self._guard(lambda: next(reader, None))
                if batch is None:
                    break
                if batch.num_rows:
                    yield batch

    def _reader(self, path: str, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
        """Streaming readers: Parquet without pre-buffering, CSV/JSON block by block (the dataset scanner's
        JSON reader loads a whole file, so memory would grow with the file)."""
        if self.format == "parquet":
            fragment = next(iter(self._dataset_of([path]).get_fragments()))
            return iter(fragment.to_batches(schema=schema, batch_size=BATCH_ROWS, batch_readahead=1, use_threads=False))
        stream = self.fs.open_input_stream(path)
        if self.format == "json":
            return self._json_blocks(stream, schema)
        types = {field.name: field.type for field in schema}
        return iter(pacsv.open_csv(stream, read_options=pacsv.ReadOptions(block_size=_BLOCK_BYTES, use_threads=False),
                                   convert_options=pacsv.ConvertOptions(column_types=types)))

    def _json_blocks(self, stream: Any, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
        """JSONL parsed by pyarrow one ~1 MiB block of whole lines at a time. (`pyarrow.json.open_json` reads
        ahead about half of a file, so its memory grows with the file.) A field the first block did not have is
        an error naming it, not a silently dropped column."""
        options = pajson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="error")
        with io.BufferedReader(stream, buffer_size=_BLOCK_BYTES) as handle:
            while lines := handle.readlines(_BLOCK_BYTES):
                table = pajson.read_json(pa.BufferReader(b"".join(lines)), pajson.ReadOptions(use_threads=False), options)
                yield from table.to_batches(BATCH_ROWS)

    def _guard(self, call: Any) -> Any:
        try:
            return call()
        except (pa.ArrowException, OSError) as exc:
            raise DatasetError(f"input {self.uri!r} ({self.format}) cannot be read: {exc}") from None


def open_dataset(uri: str, input_format: str | None = None, endpoint: str | None = None) -> Dataset:
    """A local path, a directory or glob of shards, or an s3:// URI (also a prefix or glob)."""
    fs, path = filesystem(uri, endpoint)
    files = _expand(fs, path, uri)
    if not files:
        raise DatasetError(f"input {uri!r}: no such file, or no files match")
    fmt = format_of(files[0] if not input_format else path, input_format, "input")
    return Dataset(uri, files, fmt, fs)


def _expand(fs: pafs.FileSystem, path: str, uri: str) -> list[str]:
    try:
        if any(ch in path for ch in "*?["):
            if isinstance(fs, pafs.LocalFileSystem):
                return sorted(p for p in glob.glob(path) if os.path.isfile(p))
            base = path[: min(path.find(ch) for ch in "*?[" if ch in path)].rsplit("/", 1)[0]
            infos = fs.get_file_info(pafs.FileSelector(base, recursive=True))
            return sorted(i.path for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatch(i.path, path))
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.Directory:
            infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
            return sorted(i.path for i in infos if i.type == pafs.FileType.File and not i.base_name.startswith((".", "_")))
        return [path] if info.type == pafs.FileType.File else []
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"input {uri!r} cannot be listed: {exc}") from None


def read_lines(uri: str, endpoint: str | None = None) -> Iterator[bytes]:
    """The lines of one text file, streamed (the OpenAI batch input, where every line is its own request)."""
    fs, path = filesystem(uri, endpoint)
    try:
        stream = fs.open_input_stream(path)
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"input {uri!r} cannot be read: {exc}") from None
    with io.BufferedReader(stream, buffer_size=1 << 20) as handle:  # pyarrow streams have no readline
        yield from handle


def _create_fresh(path: str) -> pa.NativeFile:
    """A new local file at `path`, never one reached through a symlink or left by someone else.

    The temporary name is predictable (`<output>.partial`): whoever can write the directory could plant a
    symlink there, and opening it would truncate the file it points to. A stale entry (an earlier run's
    partial file, or a planted link) is unlinked, which removes a link itself, not its target; the file is
    then created with O_EXCL | O_NOFOLLOW, so an entry planted in between is an error, not followed.
    """
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
    return pa.PythonFile(os.fdopen(fd, "wb", buffering=_BLOCK_BYTES), mode="w")


class Writer:
    """Writes the output in record batches: Parquet via `pq.ParquetWriter`, JSONL one object per line.

    Local outputs are written to a temporary name and renamed at the end, so a killed run never leaves a
    truncated file that looks finished; an S3 object appears only when its upload completes.
    """

    def __init__(self, uri: str, fmt: str, endpoint: str | None = None) -> None:
        self.uri = uri
        self.format = fmt
        self.fs, self.path = filesystem(uri, endpoint)
        self.local = isinstance(self.fs, pafs.LocalFileSystem)
        self.target = self.path + ".partial" if self.local else self.path
        try:
            self.stream = _create_fresh(self.target) if self.local else self.fs.open_output_stream(self.target)
        except (pa.ArrowException, OSError) as exc:
            raise DatasetError(f"output {uri!r} cannot be written: {exc}") from None
        self.parquet: pq.ParquetWriter | None = None

    def start_parquet(self, schema: pa.Schema) -> None:
        """Parquet's schema is fixed up front (so an empty or all-failed output has it too)."""
        self.parquet = pq.ParquetWriter(self.stream, schema)

    def write_batch(self, batch: pa.RecordBatch) -> None:
        assert self.parquet is not None
        self.parquet.write_batch(batch)

    def write_rows(self, rows: list[dict[str, Any]]) -> None:
        self.stream.write("".join(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in rows).encode())

    def close(self) -> None:
        if self.parquet is not None:
            self.parquet.close()
        self.stream.close()
        if self.local:
            os.replace(self.target, self.path)

    def abort(self) -> None:
        try:
            self.stream.close()
        finally:
            if self.local and os.path.exists(self.target):
                os.remove(self.target)
