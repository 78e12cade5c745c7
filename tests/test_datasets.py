"""Reading inputs with memory bounded per row: long lines and rows, compressed inputs, dictionary-encoded Parquet.

A row over `max_row_bytes` fails alone and the run goes on; compressed input is read only where its suffix
says so, bounded after decompression. Memory claims are measured in subprocesses (peak RSS, VmHWM), each
against a baseline process that reads a small file the same way; inputs are scaled to a
small limit."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from annotate_helpers import ENGINE, REPO, read_jsonl, write_jsonl

from tokenmill.apps.annotate import annotate
from tokenmill.apps.batch import batch
from tokenmill.apps.datasets import DatasetError, open_dataset
from tokenmill.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm():
    import torch

    torch.set_num_threads(1)
    from tokenmill import LLM

    return LLM("builtin:tiny", **ENGINE)


def read_all(path: Path, limit: int, input_format: str | None = None) -> list[tuple[dict, str | None]]:
    """Every row of `path` with its read error."""
    rows = []
    for record_batch, errors in open_dataset(str(path), input_format, max_row_bytes=limit).batches():
        rows += [(row, errors.get(i)) for i, row in enumerate(record_batch.to_pylist())]
    return rows


def test_a_jsonl_line_over_the_limit_fails_alone_and_a_long_one_under_it_is_read(llm, tmp_path: Path) -> None:
    """Lines over 1 MiB (pyarrow's block) used to fail the whole file ("straddles two block boundaries")."""
    data = [{"text": "a"}, {"text": "b" * 10_000}, {"text": "c"}, {"text": "d" * (2 << 20)}, {"text": "e"}]
    src = write_jsonl(tmp_path / "in.jsonl", data)
    summary = annotate(str(src), str(tmp_path / "out.jsonl"), "{{ text[:5] }}", llm=llm, quiet=True, max_tokens=2,
                       max_row_bytes=8192)
    assert (summary.ok, summary.failed) == (3, 2)
    out = read_jsonl(tmp_path / "out.jsonl")
    assert [r["text"] for r in out] == ["a", None, "c", None, "e"]
    assert out[1]["error"] == "row: 10012 bytes, over the max_row_bytes limit (8192); not read"
    assert [r["error"] is None for r in out] == [True, False, True, False, True]
    rows = read_all(src, 4 << 20)  # a 2 MiB line under a 4 MiB limit: read
    assert [error for _, error in rows] == [None] * 5 and rows[3][0]["text"] == "d" * (2 << 20)


def test_a_csv_row_over_the_limit_fails_alone_and_a_long_one_under_it_is_read(tmp_path: Path) -> None:
    src = tmp_path / "in.csv"
    src.write_text(f"id,text\n1,a\n2,{'b' * 10_000}\n3,c\n4,{'d' * (2 << 20)}\n")
    rows = read_all(src, 8192)
    assert [row["id"] for row, _ in rows] == ["1", None, "3", None]  # a CSV cell is its text
    assert [error is None for _, error in rows] == [True, False, True, False]
    assert "over the max_row_bytes limit (8192)" in rows[1][1]
    assert [row["text"][:1] for row, _ in read_all(src, 4 << 20)] == ["a", "b", "c", "d"]


def _values(path: Path) -> list[dict]:
    return [row for batch, _ in open_dataset(str(path)).batches() for row in batch.to_pylist()]


def test_values_are_read_as_the_file_wrote_them(tmp_path: Path) -> None:
    """What a prompt shows and the output keeps is the file's own value: pyarrow's inference read CSV's `007` as 7
    and `true` as True, and JSON strings that look like dates as timestamps (time zone dropped)."""
    csv = tmp_path / "in.csv"
    csv.write_text("zip,flag,when,note,empty\n007,true,2024-01-02,NA,\n010,FALSE,2024-13-45,inf,x\n")
    assert _values(csv) == [{"zip": "007", "flag": "true", "when": "2024-01-02", "note": "NA", "empty": ""},
                            {"zip": "010", "flag": "FALSE", "when": "2024-13-45", "note": "inf", "empty": "x"}]
    lines = [{"ts": "2024-01-02T03:04:05Z", "d": "2024-01-02", "t": "2024-01-02 03:04:05", "at": {"when": "2024-01-02"},
              "x": 1.5, "n": 7, "flag": True}]
    assert _values(write_jsonl(tmp_path / "in.jsonl", lines)) == lines


def test_a_json_field_null_through_the_first_block_is_read_as_text(tmp_path: Path) -> None:
    lines = [{"id": i, "note": None, "pad": "x" * 100} for i in range(12_000)] + [{"id": 12_000, "note": "late", "pad": ""}]
    values = _values(write_jsonl(tmp_path / "in.jsonl", lines))
    assert len(values) == len(lines) and values[-1] == lines[-1] and values[0] == lines[0]


def test_parquet_shards_with_different_columns_keep_every_column(tmp_path: Path) -> None:
    """The first shard's schema used to be the dataset's: a column only a later shard had was dropped unsaid."""
    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(pa.table({"id": [1, 2], "text": ["a", "b"]}), shards / "part-1.parquet")
    pq.write_table(pa.table({"id": [3], "text": ["c"], "extra": ["kept"]}), shards / "part-2.parquet")
    assert _values(shards) == [{"id": 1, "text": "a", "extra": None}, {"id": 2, "text": "b", "extra": None},
                               {"id": 3, "text": "c", "extra": "kept"}]
    assert open_dataset(str(shards)).count_rows() == 3
    pq.write_table(pa.table({"id": pa.array([4], pa.int32()), "text": pa.array(["d"], pa.large_string())}),
                   shards / "part-3.parquet")  # as another writer types them: widened, as before
    assert _values(shards)[-1] == {"id": 4, "text": "d", "extra": None}
    pq.write_table(pa.table({"id": ["five"]}), shards / "part-4.parquet")
    with pytest.raises(DatasetError, match="id"):
        open_dataset(str(shards)).schema


@pytest.mark.parametrize(("first", "second", "widened"), [
    (pa.array([1], pa.int64()), pa.array([2.5], pa.float64()), None),  # 1 would read as 1.0
    (pa.array(["a"]), pa.array([b"b"], pa.binary()), None),  # "a" would read as b"a"
    (pa.array([1], pa.int64()), pa.array([2], pa.uint64()), None),  # a uint64 may not fit
    (pa.array([[1]], pa.list_(pa.int32())), pa.array([[2]], pa.list_(pa.int64())), pa.list_(pa.int64())),
    (pa.array(["a"]).dictionary_encode().cast(pa.dictionary(pa.int8(), pa.string())), pa.array(["b"]).dictionary_encode(),
     pa.dictionary(pa.int32(), pa.string())),
])
def test_parquet_shards_typed_differently_widen_only_where_values_read_unchanged(
        tmp_path: Path, first: pa.Array, second: pa.Array, widened: pa.DataType | None) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(pa.table({"c": first}), shards / "part-0.parquet")
    pq.write_table(pa.table({"c": second}), shards / "part-1.parquet")
    if widened is None:
        with pytest.raises(DatasetError, match="Unable to merge"):
            open_dataset(str(shards)).schema
        return
    assert open_dataset(str(shards)).schema.field("c").type == widened
    assert [row["c"] for row in _values(shards)] == first.to_pylist() + second.to_pylist()


def test_a_type_change_after_blank_lines_and_a_new_field_that_is_not_utf8_are_named(tmp_path: Path) -> None:
    blanks = tmp_path / "blanks.jsonl"
    blanks.write_text('{"a": 1}\n\n\n\n{"a": 2}\n{"a": "x"}\n')
    with pytest.raises(DatasetError, match="blanks.jsonl line 6: JSON parse error: Column"):
        _values(blanks)
    rows = b"".join(json.dumps({"a": i, "t": "t" * 200}).encode() + b"\n" for i in range(6000))
    odd = tmp_path / "odd.jsonl"
    odd.write_bytes(rows + b'{"a": 1, "t": "x", "extra": "\xff"}\n')
    with pytest.raises(DatasetError, match="odd.jsonl line 6001: "):
        _values(odd)


def test_an_output_beside_an_s3_input_is_compared_with_local_inputs_only(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An S3 dataset's files are paths inside its filesystem (`bucket/key`): taken as local paths, an existing
    output crashed the check, or was refused where a local `bucket/key` existed."""
    import pyarrow.fs as pafs

    from tokenmill.apps.datasets import Dataset, check_output

    monkeypatch.chdir(tmp_path)
    (tmp_path / "bucket").mkdir()
    (tmp_path / "bucket" / "in.jsonl").write_text("{}\n")
    dataset = Dataset("s3://bucket/in.jsonl", ["bucket/in.jsonl"], "json", pafs.S3FileSystem(region="us-east-1"))
    assert dataset.uris == ["s3://bucket/in.jsonl"]
    check_output("bucket/in.jsonl", dataset.uris)  # the local file of the same name is not the input
    with pytest.raises(DatasetError, match="is the input"):
        check_output("s3://bucket/in.jsonl", dataset.uris)


def test_a_line_that_cannot_be_read_is_named_by_its_line_number(tmp_path: Path) -> None:
    """pyarrow numbers rows from the start of the ~1 MiB block it was given (from 0), not from the file's start."""
    rows = [json.dumps({"id": i, "text": "t" * 200}) for i in range(6000)]
    for bad, at in ((3, 4), (5000, 5001)):
        path = tmp_path / f"bad{bad}.jsonl"
        path.write_text("\n".join(rows[:bad] + ['{"id": 1, "text": "oops",}'] + rows[bad + 1:]) + "\n")
        with pytest.raises(DatasetError, match=f"bad{bad}.jsonl line {at}: JSON parse error: Missing a name"):
            _values(path)
    late = tmp_path / "late.jsonl"
    late.write_text("\n".join(rows + [json.dumps({"id": 1, "text": "t", "extra": 1, "at": {"new": 1}})]) + "\n")
    with pytest.raises(DatasetError, match="late.jsonl line 6001: JSON parse error: unexpected field extra, at \\("):
        _values(late)
    rows[6] = json.dumps({"id": "six", "text": "t"})  # each line reads alone: pyarrow's row names it
    typed = tmp_path / "typed.jsonl"
    typed.write_text("\n".join(rows) + "\n")
    with pytest.raises(DatasetError, match=r"typed.jsonl line 7: JSON parse error: Column\(/id\) changed from number"):
        _values(typed)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DatasetError, match=r"empty.jsonl: Empty JSON file"):  # no line to name
        _values(tmp_path / "empty.jsonl")
    csv = tmp_path / "bad.csv"
    csv.write_text("a,text\n" + "".join(f"{i},{'t' * 200}\n" for i in range(6000)) + "3\n")
    with pytest.raises(DatasetError, match="bad.csv line 6002: CSV parse error: Expected 2 columns, got 1: 3$"):
        _values(csv)


def test_floats_json_cannot_hold_are_written_as_null(tmp_path: Path) -> None:
    from tokenmill.apps.datasets import Writer

    writer = Writer(str(tmp_path / "out.jsonl"), "json")
    writer.write_rows([{"x": float("inf"), "y": [1.5, float("nan")], "z": {"w": -float("inf")}}, {"x": 2.0}])
    writer.close()
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert [json.loads(line, parse_constant=pytest.fail) for line in lines] == [
        {"x": None, "y": [1.5, None], "z": {"w": None}}, {"x": 2.0}]


def test_compressed_input_only_where_the_suffix_says_so(tmp_path: Path) -> None:
    lines = b"".join(json.dumps({"text": f"t{i}"}).encode() + b"\n" for i in range(3))
    (tmp_path / "in.jsonl.gz").write_bytes(gzip.compress(lines))
    assert [row["text"] for row, _ in read_all(tmp_path / "in.jsonl.gz", 1 << 20)] == ["t0", "t1", "t2"]
    (tmp_path / "disguised.jsonl").write_bytes(gzip.compress(lines))  # gzip bytes, a plain suffix: read as they are
    with pytest.raises(DatasetError, match="cannot be read"):
        read_all(tmp_path / "disguised.jsonl", 1 << 20)
    asked = open_dataset(str(tmp_path / "disguised.jsonl"), compression="gzip").batches()  # unless asked for
    assert [row["text"] for batch_, _ in asked for row in batch_.to_pylist()] == ["t0", "t1", "t2"]
    plain = tmp_path / "plain.jsonl.gz"  # and `none` reads a file as it is, whatever its suffix
    plain.write_bytes(lines)
    assert len(list(open_dataset(str(plain), compression="none").batches())) == 1
    with pytest.raises(DatasetError, match="input compression"):
        open_dataset(str(plain), compression="zip")
    with pytest.raises(DatasetError, match="Parquet is compressed inside"):
        (tmp_path / "x.parquet.gz").write_bytes(b"")
        open_dataset(str(tmp_path / "x.parquet.gz"))


def test_a_parquet_row_over_the_limit_fails_alone(tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": [1, 2, 3], "text": ["a", "b" * 20_000, "c"]}), tmp_path / "in.parquet")
    rows = read_all(tmp_path / "in.parquet", 8192)
    assert [(row["id"], error is None) for row, error in rows] == [(1, True), (None, False), (3, True)]
    assert rows[1][1] == "row: 20008 bytes, over the max_row_bytes limit (8192); not read"


def test_a_batch_line_over_the_limit_makes_the_file_unusable_also_gzipped(llm, tmp_path: Path) -> None:
    def request(custom_id: str, content: str) -> str:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                           "body": {"messages": [{"role": "user", "content": content}], "max_tokens": 2}})

    text = "\n".join([request("a", "hi"), request("big", "x" * 10_000), request("c", "ho")]) + "\n"
    (tmp_path / "in.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    with pytest.raises(InvalidRequestError, match=r"line 2: row: 10\d+ bytes, over the max_row_bytes limit \(4096\)"):
        batch(str(tmp_path / "in.jsonl.gz"), str(tmp_path / "out.jsonl"), llm=llm, quiet=True, max_row_bytes=4096)
    assert not (tmp_path / "out.jsonl").exists()


#: Reads an input the way annotate's passes and `tokenmill batch` do, and prints the peak RSS (KiB). The peak is
#: the process's VmHWM: `resource.getrusage(...).ru_maxrss` of a process forked from this one (the test
#: process holds a model) starts at this process's RSS, which Linux carries across exec.
_PEAK = """
import sys
from tokenmill.apps.datasets import open_dataset, read_lines
kind, path = sys.argv[1], sys.argv[2]
if kind == "lines":
    count = sum(1 for _ in read_lines(path))
else:
    count = sum(len(batch.to_pylist()) for batch, _ in open_dataset(path).batches())
status = open("/proc/self/status").read()
print(count, next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))
"""


def peak_kib(kind: str, path: Path) -> tuple[int, int]:
    done = subprocess.run([sys.executable, "-c", _PEAK, kind, str(path)], capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO)}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    count, peak = done.stdout.split()
    return int(count), int(peak)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS from /proc (Linux)")
def test_memory_is_bounded_per_row_for_gzip_bombs_and_dictionary_parquet(tmp_path: Path) -> None:
    """A 64 MiB line in 64 KiB of gzip (default limit 1 MiB), and 20,000 Parquet rows sharing one 100 KB
    dictionary value (a 2 GB table in a small file), each peak within 48 MiB of reading a small file the same
    way. Before: the line was held whole (and copied), and Parquet decoded 4096 rows per batch (~400 MB)."""
    small = write_jsonl(tmp_path / "small.jsonl", [{"text": "a"}] * 3)
    with gzip.open(tmp_path / "bomb.jsonl.gz", "wb", compresslevel=9) as bomb:
        bomb.write(b'{"text": "a"}\n{"text": "' + b"0" * (64 << 20) + b'"}\n{"text": "b"}\n')
    assert (tmp_path / "bomb.jsonl.gz").stat().st_size < 256 << 10
    value = "v" * 100_000
    column = pa.DictionaryArray.from_arrays(pa.array([0] * 20_000, pa.int32()), pa.array([value]))
    pq.write_table(pa.table({"id": pa.array(range(20_000)), "text": column}), tmp_path / "dict.parquet")
    pq.write_table(pa.table({"id": [1, 2, 3], "text": ["a", "b", "c"]}), tmp_path / "small.parquet")
    measured = {
        "lines": (peak_kib("lines", small), peak_kib("lines", tmp_path / "bomb.jsonl.gz")),
        "jsonl": (peak_kib("rows", small), peak_kib("rows", tmp_path / "bomb.jsonl.gz")),
        "parquet": (peak_kib("rows", tmp_path / "small.parquet"), peak_kib("rows", tmp_path / "dict.parquet")),
    }
    print({kind: (base[1] // 1024, big[1] // 1024) for kind, (base, big) in measured.items()}, "MiB")
    assert [big[0] for _, big in measured.values()] == [3, 3, 20_000]
    for kind, (base, big) in measured.items():
        assert big[1] - base[1] < 48 << 10, f"{kind}: peak {big[1] >> 10} MiB vs {base[1] >> 10} MiB reading a small file"
