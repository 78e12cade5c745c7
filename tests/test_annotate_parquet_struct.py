"""`parsed` in Parquet: a struct column typed by the run's JSON schema (tokenmill/apps/arrow_schema.py), JSON text
where the schema cannot be mapped faithfully; JSONL keeps JSON values."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from annotate_helpers import ENGINE, read_jsonl, write_jsonl

from tokenmill.apps.annotate import annotate
from tokenmill.apps.arrow_schema import arrow_type, parsed_column

TAG = {"type": "object", "properties": {"name": {"type": "string", "enum": ["a", "b"]}, "ok": {"type": "boolean"}},
       "required": ["name", "ok"]}
#: What the built-in tiny model completes within 200 tokens, every kind of column in it.
SCHEMA = {
    "$defs": {"Tag": TAG},
    "type": "object",
    "properties": {
        "label": {"type": "string", "enum": ["pos", "neg"]},
        "score": {"type": "number", "enum": [1, 2.5]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "note": {"type": ["string", "null"], "maxLength": 3},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/Tag"}, "minItems": 1, "maxItems": 2},
        "meta": {"type": "object", "properties": {"flag": {"type": "boolean"}}, "required": ["flag"]},
    },
    "required": ["label", "score", "count", "note", "tags", "meta"],
}
TAG_TYPE = pa.struct([("name", pa.string()), ("ok", pa.bool_())])
SCHEMA_TYPE = pa.struct([("label", pa.string()), ("score", pa.float64()), ("count", pa.int64()), ("note", pa.string()),
                         ("tags", pa.list_(TAG_TYPE)), ("meta", pa.struct([("flag", pa.bool_())]))])


def obj(**properties):
    return {"type": "object", "properties": properties}


@pytest.mark.parametrize("schema, expected", [
    (obj(a=obj(b={"type": "integer"}, c={"type": "number"})), pa.struct([("a", pa.struct([("b", pa.int64()), ("c", pa.float64())]))])),
    (obj(z={"type": "boolean"}, a={"type": "string"}), pa.struct([("z", pa.bool_()), ("a", pa.string())])),  # property order
    (obj(xs={"type": "array", "items": TAG}), pa.struct([("xs", pa.list_(TAG_TYPE))])),
    (obj(a={"type": ["integer", "null"]}, b={"anyOf": [{"type": "number"}, {"type": "null"}], "default": None},
         c={"oneOf": [{"type": "null"}, TAG]}), pa.struct([("a", pa.int64()), ("b", pa.float64()), ("c", TAG_TYPE)])),
    (obj(s={"enum": ["x", "y"]}, n={"enum": [1, 2, None]}, c={"const": "k"}, m={"enum": [1, "x"]}),
     pa.struct([("s", pa.string()), ("n", pa.int64()), ("c", pa.string()), ("m", pa.string())])),
    ({**obj(t={"$ref": "#/$defs/Tag"}, u={"$ref": "#/definitions/Tag", "description": "old style"}),
      "$defs": {"Tag": TAG}, "definitions": {"Tag": TAG}}, pa.struct([("t", TAG_TYPE), ("u", TAG_TYPE)])),
    ({"$ref": "#/$defs/Tag", "$defs": {"Tag": TAG}}, TAG_TYPE),
    (obj(map={"type": "object", "additionalProperties": {"type": "integer"}}, any={}, either={"oneOf": [{"type": "string"}, {"type": "integer"}]},
         remote={"$ref": "https://example.com/s.json"}, missing={"$ref": "#/$defs/Nope"}, pair={"type": "array", "prefixItems": [{"type": "string"}]}),
     pa.struct([(name, pa.string()) for name in ("map", "any", "either", "remote", "missing", "pair")])),
    (None, pa.string()),
])
def test_json_schema_maps_to_an_arrow_type(schema, expected) -> None:
    assert arrow_type(schema) == expected


def test_recursive_definitions_are_json_text() -> None:
    node = obj(value={"type": "integer"}, children={"type": "array", "items": {"$ref": "#/$defs/Node"}})
    schema = {**obj(tree={"$ref": "#/$defs/Node"}, size={"type": "integer"}), "$defs": {"Node": node}}
    assert arrow_type(schema) == pa.struct([("tree", pa.string()), ("size", pa.int64())])
    mutual = {**obj(a={"$ref": "#/$defs/A"}), "$defs": {"A": obj(b={"$ref": "#/$defs/B"}), "B": obj(a={"anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}]})}}
    assert arrow_type(mutual) == pa.struct([("a", pa.string())])
    assert arrow_type(obj(me={"$ref": "#"}, n={"type": "integer"})) == pa.string()
    values = parsed_column(schema).values(['{"tree": {"value": 1, "children": []}, "size": 1}'])
    assert values == [{"tree": '{"value": 1, "children": []}', "size": 1}]


def test_values_convert_to_their_column() -> None:
    column = parsed_column(obj(x={"type": "number"}, n={"type": "integer"}, m={"type": "object", "additionalProperties": True},
                               t={"type": "array", "items": {"type": "number"}}, s={"type": "string"}))
    texts = ['{"x": 2, "n": 3.0, "m": {"k": [1, "é"]}, "t": [1, 2.5], "s": "hi"}', '{"n": 99999999999999999999}', None]
    values = column.values(texts)
    assert values == [{"x": 2.0, "n": 3, "m": '{"k": [1, "é"]}', "t": [1.0, 2.5], "s": "hi"},
                      {"x": None, "n": None, "m": None, "t": None, "s": None}, None]  # past int64: null
    assert isinstance(values[0]["x"], float) and isinstance(values[0]["t"][0], float)
    array = pa.array(values, column.type)
    assert array.null_count == 1 and array.to_pylist()[0] == values[0]


@pytest.fixture(scope="module")
def llm():
    import torch

    torch.set_num_threads(1)
    from tokenmill import LLM

    return LLM("builtin:tiny", **ENGINE)


def test_annotate_writes_the_schema_as_a_parquet_struct_column(llm, tmp_path: Path) -> None:
    """The Parquet column's type is the schema's struct; its values are the JSONL run's parsed objects (the number
    field's integers as floats); a failed row's value is null; the schema is the same when every row fails."""
    rows = [{"id": f"r{i}", "text": f"item {i}"} for i in range(5)] + [{"id": "bad"}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    kw = dict(llm=llm, quiet=True, json_schema=SCHEMA, max_tokens=200, id_column="id")
    annotate(str(src), str(tmp_path / "out.jsonl"), "Say: {{ text }}", **kw)
    summary = annotate(str(src), str(tmp_path / "out.parquet"), "Say: {{ text }}", **kw)
    assert (summary.ok, summary.failed) == (5, 1)

    table = pq.read_table(tmp_path / "out.parquet")
    assert table.schema.field("parsed").type == SCHEMA_TYPE
    expected = [row["parsed"] for row in read_jsonl(tmp_path / "out.jsonl")]
    parsed = table.column("parsed").to_pylist()
    assert all(isinstance(value, dict) for value in expected[:5]) and expected[5] is None
    assert parsed == expected
    assert all(isinstance(value["score"], float) and value["tags"] for value in parsed[:5])

    failed = annotate(str(write_jsonl(tmp_path / "bad.jsonl", rows[:2])), str(tmp_path / "bad.parquet"),
                      "Say: {{ text.nope }}", **kw)  # every row fails
    assert failed.failed == 2 and pq.read_schema(tmp_path / "bad.parquet") == table.schema
