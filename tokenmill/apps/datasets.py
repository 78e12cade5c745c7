"""Datasets in and out: JSONL, CSV or Parquet, local or `s3://`, read and written in record batches.

Everything here goes through pyarrow (its dataset scanner and its S3 filesystem), so there is no
hand-written CSV, JSON-lines or multipart-upload code. A dataset is read twice by the pipeline (once to
compute, once to write the output from the checkpoint), each time as a stream of record batches, so
memory stays bounded whatever the input size.

Memory is bounded per row too: no row is held whole beyond `max_row_bytes` (default 1 MiB, as the queue's
`max_job_bytes`). A longer JSONL/CSV line is skipped to its end unread and a Parquet row over the limit is not
decoded: either becomes a row of nulls carrying its error, and the run goes on. Compressed JSONL/CSV is read
only where the file's suffix names the codec (`.gz`, `.bz2`, `.zst`, `.lz4`), and its lines are bounded after
decompression, so a small gzip bomb is as harmless as a large file.
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import io
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.json as pajson
import pyarrow.parquet as pq

FORMATS = {".jsonl": "json", ".ndjson": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
#: Rows per record batch handed to the pipeline (Parquet; JSON/CSV batches follow their block size).
BATCH_ROWS = 4096
_BLOCK_BYTES = 1 << 20  # CSV/JSON read block
#: Decoded bytes per record batch handed on (Parquet), whatever the rows per batch: a small file whose rows
#: share one large dictionary value would otherwise decode to hundreds of megabytes per `BATCH_ROWS` rows.
_BATCH_BYTES = 8 << 20
#: The default of `max_row_bytes`: the largest row or line read whole (the queue's `max_job_bytes` too).
MAX_ROW_BYTES = 1 << 20
#: Compression suffixes of JSONL/CSV inputs, as pyarrow names the codecs. No other input is decompressed.
COMPRESSION = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".lz4": "lz4"}
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
    stem, extension = os.path.splitext(path.rstrip("/"))
    if extension.lower() in COMPRESSION:
        extension = os.path.splitext(stem)[1]
    extension = extension.lower()
    if extension not in FORMATS:
        raise DatasetError(
            f"{what} {path!r}: cannot tell the format from the extension {extension or '(none)'!r} "
            f"(known: {', '.join(sorted(FORMATS))}); name the format with --{what}-format"
        )
    return FORMATS[extension]


def compression_of(path: str, asked: str | None = None) -> str | None:
    """The codec to read `path` with: the one asked for (`none`: read as it is), else the one its suffix names
    (`data.jsonl.gz`: gzip), else None: read as it is."""
    if asked is not None:
        return None if asked == "none" else asked
    return COMPRESSION.get(os.path.splitext(path)[1].lower())


def check_compression(asked: str | None) -> None:
    known = ("none", *COMPRESSION.values())
    if asked is not None and asked not in known:
        raise DatasetError(f"input compression: must be one of {', '.join(known)}, got {asked!r}")


@dataclass
class TooLong:
    """A line longer than the limit, skipped unread: its size in bytes (decompressed)."""

    size: int


def bounded_lines(handle: Any, limit: int) -> Iterator[bytes | TooLong]:
    """The lines of a buffered binary stream, none held beyond `limit` bytes (its newline not counted): a longer
    one is read on to its end in `_BLOCK_BYTES` pieces and dropped, and comes out as `TooLong`."""
    while line := handle.readline(limit + 1):
        if len(line) <= limit or (len(line) == limit + 1 and line.endswith(b"\n")):
            yield line
            continue
        size = len(line)
        while not line.endswith(b"\n") and (line := handle.readline(_BLOCK_BYTES)):
            size += len(line)
        yield TooLong(size - line.endswith(b"\n"))


def too_long(size: int, limit: int) -> str:
    """A row's error when the row is over the limit."""
    return f"row: {size} bytes, over the max_row_bytes limit ({limit}); not read"


@dataclass
class Dataset:
    """An input dataset: its shard files in order and their format. `batches()` yields each record batch with
    the errors of its rows that could not be read (row index -> message; those rows are all null)."""

    uri: str
    files: list[str]
    format: str
    fs: pafs.FileSystem
    max_row_bytes: int = MAX_ROW_BYTES
    compression: str | None = None  # asked for; None: by each file's suffix

    def _dataset(self) -> ds.Dataset:
        """The Parquet files as one pyarrow dataset (for the row count from the footers)."""
        return ds.dataset(self.files, format="parquet", filesystem=self.fs, schema=self.schema)

    @functools.cached_property
    def schema(self) -> pa.Schema:
        """Parquet: every file's columns (a shard without one reads it as nulls; one column of two types takes the
        wider, int32 and int64 as int64, string and large_string as large_string; types that do not widen into one
        another are an error). CSV/JSONL: inferred by pyarrow from the first file's first block of lines (lines
        over the limit skipped), so one long line cannot fail the dataset, then made to keep values as the file
        wrote them (`_as_written`)."""
        if self.format == "parquet":
            return self._guard(self._parquet_schema)
        return self._guard(lambda: self._text_schema(self.files[0]))

    def _parquet_schema(self) -> pa.Schema:
        """Every shard's columns, a column typed differently by two shards widened only as the docstring of `schema`
        says (pyarrow's permissive unification would also turn ints into doubles, strings into bytes)."""
        schemas = [pq.read_schema(path, filesystem=self.fs) for path in self.files]
        try:
            return pa.unify_schemas(schemas)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as strict:
            wide = pa.unify_schemas(schemas, promote_options="permissive")
            if all(_widens(field.type, wide.field(field.name).type) for schema in schemas for field in schema):
                return wide
            raise strict

    def _text_schema(self, path: str) -> pa.Schema:
        with self._open_text(path) as handle:
            lines = enumerate(bounded_lines(handle, self.max_row_bytes), 1)
            header = next((line for _, line in lines if not isinstance(line, TooLong)), b"") \
                if self.format == "csv" else b""
            numbers, block = self._block(lines)
        try:
            inferred = self._read_block(header, block, None)
        except pa.ArrowInvalid as exc:
            raise self._unreadable(exc, header, block, None, path, numbers.__getitem__) from None
        return pa.schema([f.with_type(_as_written(f.type, self.format == "csv")) for f in inferred.schema])

    def _block(self, lines: Iterator[tuple[int, bytes | TooLong]]) -> tuple[list[int], list[bytes]]:
        """Whole lines up to about `_BLOCK_BYTES`, with their line numbers (the first block: lines over the limit
        skipped)."""
        numbers, block, size = [], [], 0
        for number, line in lines:
            if isinstance(line, TooLong):
                continue
            numbers.append(number)
            block.append(line)
            size += len(line)
            if size >= _BLOCK_BYTES:
                break
        return numbers, block

    @property
    def uris(self) -> list[str]:
        """The shard files as URIs (`files` are paths inside `fs`: an S3 one without its scheme)."""
        return self.files if isinstance(self.fs, pafs.LocalFileSystem) else [f"s3://{path}" for path in self.files]

    def _open_text(self, path: str) -> io.BufferedReader:
        stream = self.fs.open_input_stream(path, compression=compression_of(path, self.compression))
        return io.BufferedReader(stream, buffer_size=_BLOCK_BYTES)  # pyarrow streams have no readline

    def count_rows(self) -> int:
        """Parquet: from the footers. CSV/JSONL: one streaming pass (which also finds a corrupt file before any
        work starts)."""
        if self.format == "parquet":
            return self._guard(lambda: self._dataset().count_rows())
        return sum(batch.num_rows for batch, _ in self.batches())

    def batches(self) -> Iterator[tuple[pa.RecordBatch, dict[int, str]]]:
        """The rows in file order, then row order, as record batches of bounded size, each with its rows' errors."""
        schema = self.schema
        for path in self.files:
            reader = self._guard(lambda: self._reader(path, schema))
            while True:
                item = self._guard(lambda: next(reader, None))
                if item is None:
                    break
                if item[0].num_rows:
                    yield item

    def _reader(self, path: str, schema: pa.Schema) -> Iterator[tuple[pa.RecordBatch, dict[int, str]]]:
        """Streaming readers: Parquet without pre-buffering, CSV/JSON block by block of bounded lines (the
        dataset scanner's JSON reader loads a whole file, so memory would grow with the file)."""
        if self.format == "parquet":
            return self._parquet_batches(path, schema)
        return self._text_batches(path, schema)

    def _text_batches(self, path: str, schema: pa.Schema) -> Iterator[tuple[pa.RecordBatch, dict[int, str]]]:
        """JSONL or CSV parsed by pyarrow one ~1 MiB block of whole lines at a time (`pyarrow.json.open_json`
        reads ahead about half of a file; both pyarrow readers fail a whole file on a line longer than their
        block). A JSON field the first block did not have is an error naming it, not a silently dropped column.
        CSV values hold no newlines (pyarrow's default), so a CSV row is a line too."""
        with self._open_text(path) as handle:
            lines = bounded_lines(handle, self.max_row_bytes)
            header = next(lines, b"") if self.format == "csv" else b""
            if isinstance(header, TooLong):
                raise DatasetError(f"input {self.uri!r}: the CSV header of {path} is over max_row_bytes ({self.max_row_bytes})")
            block: list[bytes] = []
            size, first = 0, 2 if header else 1  # `first`: the file's line number of block[0]
            for line in lines:
                if isinstance(line, TooLong):
                    yield from self._parse(header, block, schema, (path, first))
                    block, size, first = [], 0, first + len(block) + 1
                    yield _null_row(schema), {0: too_long(line.size, self.max_row_bytes)}
                    continue
                block.append(line)
                size += len(line)
                if size >= _BLOCK_BYTES:
                    yield from self._parse(header, block, schema, (path, first))
                    block, size, first = [], 0, first + len(block)
            yield from self._parse(header, block, schema, (path, first))

    def _parse(self, header: bytes, block: list[bytes], schema: pa.Schema, where: tuple[str, int]
               ) -> Iterator[tuple[pa.RecordBatch, dict[int, str]]]:
        """`block`'s lines as record batches; a block pyarrow cannot read is an error naming the file's first line
        that cannot be read alone (pyarrow counts rows from the block's start), and a new JSON field by name."""
        if not block:
            return
        try:
            table = self._read_block(header, block, schema)
        except pa.ArrowInvalid as exc:
            path, first = where
            raise self._unreadable(exc, header, block, schema, path, lambda index: first + index) from None
        for batch in table.to_batches(BATCH_ROWS):
            yield batch, {}

    def _read_block(self, header: bytes, block: list[bytes], schema: pa.Schema | None) -> pa.Table:
        """The lines as one table, of `schema` (None: inferred)."""
        data = b"".join([header, *block])
        if self.format == "csv":
            types = {field.name: field.type for field in schema or ()}
            return pacsv.read_csv(pa.BufferReader(data), _csv_read(), convert_options=pacsv.ConvertOptions(column_types=types))
        options = pajson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="error" if schema else "infer")
        return pajson.read_json(pa.BufferReader(data), _json_read(len(data)), options)

    def _unreadable(self, error: pa.ArrowInvalid, header: bytes, block: list[bytes], schema: pa.Schema | None,
                    path: str, number_of: Callable[[int], int]) -> DatasetError:
        """The error of a block pyarrow cannot read, naming the first of its lines (`number_of` its index: the file's
        line number) that cannot be read alone, as pyarrow counts rows from the block's start; and a new JSON field
        by its name."""
        row = re.search(r" in row (\d+)$", str(error))  # counted from the block's start, blank lines skipped
        filled = [at for at, line in enumerate(block) if line.strip()] if self.format == "json" else range(len(block))
        index = filled[int(row[1])] if row and int(row[1]) < len(filled) else 0
        for at, line in enumerate(block):  # a line that cannot be read alone, where pyarrow names none or a later one
            try:
                self._read_block(header, [line], schema)
            except pa.ArrowInvalid as alone:
                error, index = alone, at
                break
        said = re.sub(r" in row \d+$|Row #\d+: ", "", str(error))
        if schema is not None and self.format == "json" and said.endswith("unexpected field"):
            try:
                new = ", ".join(_new_fields(json.loads(block[index]), pa.struct(list(schema))))
            except ValueError:  # not UTF-8 or not JSON: pyarrow named the field first
                new = ""
            said += f" {new or '(not named)'} (a JSON file's fields are those of its first MiB)"
        line = f" line {number_of(index)}" if block else ""  # an empty file has none
        return DatasetError(f"input {self.uri!r} ({self.format}) cannot be read: {path}{line}: {said}")

    def _parquet_batches(self, path: str, schema: pa.Schema) -> Iterator[tuple[pa.RecordBatch, dict[int, str]]]:
        """Row groups read with their string and binary columns still dictionary-encoded (so a batch costs its
        indices, not its values), then decoded `_BATCH_BYTES` at a time; a row over the limit is never decoded."""
        text = [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)
                or pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type)]
        # pre-buffering would read a whole file's column chunks at once: memory would grow with the file
        fmt = ds.ParquetFileFormat(read_options=ds.ParquetReadOptions(dictionary_columns=text),
                                   default_fragment_scan_options=ds.ParquetFragmentScanOptions(pre_buffer=False))
        fragment = next(iter(ds.dataset([path], format=fmt, filesystem=self.fs).get_fragments()))
        encoded = pa.schema([f.with_type(pa.dictionary(pa.int32(), f.type)) if f.name in text else f for f in schema])
        for batch in fragment.to_batches(schema=encoded, batch_size=BATCH_ROWS, batch_readahead=0, use_threads=False):
            yield from self._decoded(batch, schema)

    def _decoded(self, batch: pa.RecordBatch, schema: pa.Schema) -> Iterator[tuple[pa.RecordBatch, dict[int, str]]]:
        sizes = _row_bytes(batch).to_pylist()
        start = total = 0
        for index, size in enumerate(sizes):
            if size > self.max_row_bytes:
                if index > start:
                    yield batch.slice(start, index - start).cast(schema), {}
                yield _null_row(schema), {0: too_long(size, self.max_row_bytes)}
                start, total = index + 1, 0
                continue
            if total + size > _BATCH_BYTES and index > start:
                yield batch.slice(start, index - start).cast(schema), {}
                start, total = index, 0
            total += size
        if start < len(sizes):
            yield batch.slice(start).cast(schema), {}

    def _guard(self, call: Any) -> Any:
        try:
            return call()
        except (pa.ArrowException, OSError) as exc:
            raise DatasetError(f"input {self.uri!r} ({self.format}) cannot be read: {exc}") from None


def _widens(narrow: pa.DataType, wide: pa.DataType) -> bool:
    """Whether a shard's column type reads unchanged as the dataset's: the same, null, a narrower integer of the same
    signedness, string/binary as their large forms, or a dictionary, struct or list of such."""
    if narrow == wide or pa.types.is_null(narrow):
        return True
    if pa.types.is_integer(narrow) and pa.types.is_integer(wide):
        signed = pa.types.is_signed_integer(narrow) == pa.types.is_signed_integer(wide)
        return signed and narrow.bit_width <= wide.bit_width
    pairs = ((pa.types.is_string, pa.types.is_large_string), (pa.types.is_binary, pa.types.is_large_binary))
    if any(small(narrow) and (small(wide) or large(wide)) for small, large in pairs):
        return True
    if pa.types.is_dictionary(narrow) and pa.types.is_dictionary(wide):  # index widths differ between writers
        return _widens(narrow.value_type, wide.value_type)
    if pa.types.is_struct(narrow) and pa.types.is_struct(wide):
        kinds = {field.name: field.type for field in wide}
        return all(field.name in kinds and _widens(field.type, kinds[field.name]) for field in narrow)
    if (pa.types.is_list(narrow) or pa.types.is_large_list(narrow)) and \
            (pa.types.is_list(wide) or pa.types.is_large_list(wide)):
        return _widens(narrow.value_type, wide.value_type)
    return False


def _new_fields(value: Any, data_type: pa.DataType, prefix: str = "") -> list[str]:
    """The fields of a JSON `value` that the struct `data_type` lacks, by path (`a.b`)."""
    if isinstance(value, list) and (pa.types.is_list(data_type) or pa.types.is_large_list(data_type)):
        return sorted({name for item in value for name in _new_fields(item, data_type.value_type, prefix)})
    if not isinstance(value, dict) or not pa.types.is_struct(data_type):
        return []
    known = {field.name: field.type for field in data_type}
    return [name for key, item in value.items()
            for name in ([prefix + key] if key not in known else _new_fields(item, known[key], f"{prefix}{key}."))]


def _as_written(data_type: pa.DataType, csv: bool) -> pa.DataType:
    """The type that keeps a column's values as the file wrote them, in prompts and in the output: a CSV cell is its
    text (`007` stays `007`, `true` and `NA` stay text) unless it is not UTF-8 (binary); a JSON string pyarrow would
    read as a date or time stays the string (its time zone, its spelling), and a field null throughout the first
    block is read as text, the type a later value most often has."""
    if pa.types.is_binary(data_type) or pa.types.is_large_binary(data_type):
        return data_type
    if csv or pa.types.is_temporal(data_type) or pa.types.is_null(data_type):
        return pa.string()
    if pa.types.is_struct(data_type):
        return pa.struct([field.with_type(_as_written(field.type, csv)) for field in data_type])
    if pa.types.is_list(data_type):
        return pa.list_(_as_written(data_type.value_type, csv))
    if pa.types.is_large_list(data_type):
        return pa.large_list(_as_written(data_type.value_type, csv))
    return data_type


def _csv_read() -> pacsv.ReadOptions:
    return pacsv.ReadOptions(block_size=MAX_INT32, use_threads=False)  # one block: the lines given


def _json_read(size: int) -> pajson.ReadOptions:
    return pajson.ReadOptions(block_size=max(size + 1, _BLOCK_BYTES), use_threads=False)  # one block: the lines given


MAX_INT32 = 2**31 - 1


def _null_row(schema: pa.Schema) -> pa.RecordBatch:
    """The stand-in of a row that was not read: one row of nulls."""
    return pa.RecordBatch.from_arrays([pa.nulls(1, f.type) for f in schema], schema=schema)


def _row_bytes(batch: pa.RecordBatch) -> pa.Array:
    """Each row's decoded size: its string and binary values' bytes (dictionary-encoded ones looked up, not
    decoded), and the average bytes per row of its other columns."""
    total = pa.array([0] * batch.num_rows, pa.int64())
    for column in batch.columns:
        values = column.dictionary if pa.types.is_dictionary(column.type) else column
        if pa.types.is_string(values.type) or pa.types.is_large_string(values.type) or pa.types.is_binary(values.type) \
                or pa.types.is_large_binary(values.type):
            lengths = pc.binary_length(values)
            if pa.types.is_dictionary(column.type):
                lengths = pc.take(lengths, column.indices)
            total = pc.add(total, pc.fill_null(lengths.cast(pa.int64()), 0))
        else:
            total = pc.add(total, column.nbytes // max(batch.num_rows, 1))
    return total


def open_dataset(uri: str, input_format: str | None = None, endpoint: str | None = None,
                 max_row_bytes: int = MAX_ROW_BYTES, compression: str | None = None) -> Dataset:
    """A local path, a directory or glob of shards, or an s3:// URI (also a prefix or glob). `compression`: the
    JSONL/CSV codec (`none`, gzip, bz2, zstd, lz4); by default each file's suffix decides."""
    if isinstance(max_row_bytes, bool) or not isinstance(max_row_bytes, int) or max_row_bytes < 1:
        raise DatasetError(f"max_row_bytes: must be a positive integer, got {max_row_bytes!r}")
    check_compression(compression)
    fs, path = filesystem(uri, endpoint)
    files = _expand(fs, path, uri)
    if not files:
        raise DatasetError(f"input {uri!r}: no such file, or no files match")
    fmt = format_of(files[0] if not input_format else path, input_format, "input")
    if fmt == "parquet" and compression_of(files[0], compression):
        raise DatasetError(f"input {uri!r}: Parquet is compressed inside; give the .parquet file itself")
    return Dataset(uri, files, fmt, fs, max_row_bytes, compression)


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


def read_lines(uri: str, endpoint: str | None = None, max_row_bytes: int = MAX_ROW_BYTES,
               compression: str | None = None) -> Iterator[bytes | TooLong]:
    """The lines of one text file, streamed (the OpenAI batch input, where every line is its own request), each
    held to `max_row_bytes` (decompressed, for a `.gz`/`.bz2`/`.zst`/`.lz4` file or the `compression` asked
    for): a longer one is `TooLong`."""
    check_compression(compression)
    fs, path = filesystem(uri, endpoint)
    try:
        stream = fs.open_input_stream(path, compression=compression_of(path, compression))
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"input {uri!r} cannot be read: {exc}") from None
    with io.BufferedReader(stream, buffer_size=_BLOCK_BYTES) as handle:  # pyarrow streams have no readline
        try:
            yield from bounded_lines(handle, max_row_bytes)
        except (pa.ArrowException, OSError) as exc:  # e.g. a corrupt gzip stream
            raise DatasetError(f"input {uri!r} cannot be read: {exc}") from None


def check_output(uri: str, inputs: list[str], what: str = "output") -> None:
    """Refuse, before any work, an output that cannot be written as named: with a compression suffix (outputs are
    written plain), an existing directory, a path under a file, or one of the `inputs` itself (local paths, or
    s3:// URIs), which the output would replace."""
    suffix = os.path.splitext(uri)[1].lower()
    if suffix in COMPRESSION:
        raise DatasetError(f"{what} {uri!r}: outputs are written uncompressed; name it without {suffix} (compress it "
                           "after the run)")
    if uri.startswith("s3://"):
        if uri.removeprefix("s3://") in {source.removeprefix("s3://") for source in inputs}:
            raise DatasetError(f"{what} {uri!r} is the input; write the {what} to another object")
        return
    path = os.path.abspath(uri)
    if os.path.isdir(path):
        raise DatasetError(f"{what} {uri!r} is a directory; name a file in it")
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise DatasetError(f"{what} {uri!r}: {parent} is a file, not a directory")
    for source in inputs:
        if "://" not in source and os.path.exists(path) and os.path.exists(source) and os.path.samefile(path, source):
            raise DatasetError(f"{what} {uri!r} is the input {source!r}, which it would replace; write the {what} to "
                               "another file")


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


def _json_line(row: dict[str, Any]) -> str:
    """`row` as a line of JSON: a float JSON cannot hold (NaN, infinities) is null, as JSON has no such value."""
    try:
        return json.dumps(row, ensure_ascii=False, default=str, allow_nan=False) + "\n"
    except ValueError:
        return json.dumps(_finite(row), ensure_ascii=False, default=str) + "\n"


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


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
        self.stream.write("".join(_json_line(row) for row in rows).encode())

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
