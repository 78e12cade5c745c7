"""`tokenmill.queue.fastjson`: orjson only where it reads and writes what the stdlib and kombu would."""

from __future__ import annotations

import datetime
import json
import math
import uuid
from typing import Any

import orjson
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from kombu.utils.json import dumps as kombu_dumps
from kombu.utils.json import loads as kombu_loads

from tokenmill.queue import fastjson

_scalars = (st.none() | st.booleans() | st.floats(allow_nan=True, allow_infinity=True)
            | st.integers(min_value=-(2**70), max_value=2**70) | st.text()
            | st.sampled_from(["__type__", "__value__", "datetime", "\\u005f", "\u00e9", "12345678901234567890"]))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8) | st.sampled_from(["__type__", "__value__"]), inner, max_size=4), max_leaves=20)


def same(a: Any, b: Any) -> bool:
    """Equal, of the same types all the way down (so 2**64 is not 1.8e19), NaN equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@given(_values, st.booleans())
@example({"n": 2**64}, True)  # orjson reads it as a float
@example({"n": -(2**63) - 1}, True)
@example({"when": {"__type__": "datetime", "__value__": "2026-12-01T00:00:00"}}, True)
@example({"when": {"__type__": "datetime", "__value__": "2026-12-01T00:00:00"}}, False)
@example([float("inf"), float("nan")], True)
def test_loads_reads_what_kombu_and_the_stdlib_read(value: Any, ascii_only: bool) -> None:
    """Whatever text the stdlib writes (escaped or not), `loads` reads what kombu's decoder reads and
    `plain_loads` what `json.loads` reads, from str and bytes; or both refuse it."""
    text = json.dumps(value, ensure_ascii=ascii_only)
    for data in (text, text.encode()):
        try:
            expected = kombu_loads(data)
        except Exception as refusal:  # kombu's hook refuses an unknown or unhashable "__type__": so must `loads`
            with pytest.raises(type(refusal)):
                fastjson.loads(data)
        else:
            assert same(fastjson.loads(data), expected), text
        assert same(fastjson.plain_loads(data), json.loads(data)), text


def test_kombu_types_and_escaped_keys_come_back_as_kombu_decodes_them() -> None:
    when = datetime.datetime(2026, 12, 1, 12, 30, tzinfo=datetime.timezone.utc)
    job = uuid.UUID(int=7)
    text = kombu_dumps({"eta": when, "id": job})
    assert fastjson.loads(text) == {"eta": when, "id": job}
    escaped = '{"\\u005f_type__": "datetime", "__value__": "%s"}' % when.isoformat()  # the key spelled with an escape
    assert fastjson.loads(escaped) == when


@given(_values)
@example({"parsed": float("nan"), "big": 2**64})
@example([float("-inf")])
@example([None, "a", 1.5, float("nan")])  # a result's free parts: mostly None, strings and times
@example([{}, [], None, {"a": [float("inf")]}])  # empty metadata is skipped, a nested infinity is not
@example((None, {"k": [2**64]}))
@example({1: "a key that is no string"})
def test_dumps_writes_what_the_stdlib_writes(value: Any) -> None:
    """`dumps` of a message whose free-form part is `value` reads back as the stdlib's JSON of it does."""
    message = {"op": "done", "free": value}
    written = fastjson.dumps(message, value)
    assert same(json.loads(written), json.loads(json.dumps(message)))


def test_dumps_uses_orjson_for_plain_values_and_the_stdlib_otherwise() -> None:
    """The check of free-form parts is what keeps non-finite floats from becoming null."""
    plain = {"id": "a", "times": [1.5, 2.0], "ids": [1, 2, 3], "text": "é"}
    assert fastjson.dumps(plain, plain["times"]) == orjson.dumps(plain)
    assert json.loads(fastjson.dumps({"x": float("-inf")}, float("-inf"))) == {"x": float("-inf")}
    assert json.loads(fastjson.dumps({"x": [2**80]}, [2**80])) == {"x": [2**80]}


def test_plain_loads_reads_escaped_control_characters_with_orjson(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's outputs escape control characters as `\\u00XX`: only kombu's decoder must see those (they can
    spell its `__type__` key), so the engine pipe's `plain_loads` keeps orjson for them."""
    text = orjson.dumps({"text": "a\x01b\x1f", "__type__": "not kombu's here"})
    assert b"\\u0001" in text
    monkeypatch.setattr(fastjson.json, "loads", lambda data: pytest.fail("the stdlib read it"))
    assert fastjson.plain_loads(text) == {"text": "a\x01b\x1f", "__type__": "not kombu's here"}


@given(_values)
@example({"t": 1e-05, "u": 1e16, "v": 5e-324})  # exponent forms the stdlib writes otherwise
@example(6.103515625e-05)  # below 1e-4 orjson wrote it out (0.00006103515625), the stdlib with an exponent
@example({"text": "caf\u00e9 \x7f \x00 \n"})  # escapes the stdlib makes
@example({"seed": 2**64, "nan": float("nan")})
@example({"b": {"z": 1, "a": [True, None, 0.1]}, "a": ""})
def test_canonical_is_the_stdlibs_sorted_json_to_the_byte(value: Any) -> None:
    """Content hashes must not change with the encoder: `canonical` is byte-identical to the stdlib's."""
    content = {"free": value, "fixed": [1, 2.5, "x"]}
    assert fastjson.canonical(content, value) == json.dumps(content, sort_keys=True, separators=(",", ":")).encode()


def test_canonical_of_a_typical_job_is_orjsons() -> None:
    """The typical job takes orjson's path (the point of `canonical`), and hashes as before."""
    from tokenmill.queue.schemas import Job

    wire = Job.from_wire({"prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0.7, "metadata": {"row": 3}}).to_wire()
    assert fastjson.canonical(wire, wire["metadata"]) == orjson.dumps(wire, option=orjson.OPT_SORT_KEYS)
    assert fastjson.canonical(wire, wire["metadata"]) == json.dumps(wire, sort_keys=True, separators=(",", ":")).encode()
